"""A loader's own fault named with its cause and its fix (:mod:`pytest_llmload.loader.faults`), known by what raised
it: each wording as the installed stack's own code raises it, and the same wording from the loader's own code is
nothing known. Then :class:`~pytest_llmload.loader.seam.LoaderError` says it, and names the loader's frames only.

Before (issue 46): a loader error showed the raw exception and a line, and its "in the loader's code" could name
this plugin's spy (failures/adapter_on_offloaded.py:173).
"""

import importlib.util
import pickle

from importlib import metadata

import pytest
from packaging.version import Version

from fixtures.loaders import fault_cuda_current_device, fault_transformers4_keywords
from pytest_llmload.loader.faults import COMPILE_CACHE_FIX, DEVICE_FIX, PAD_TOKEN_FIX, REMOVED_KEYWORDS, diagnose
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.loader.seam import LoaderError, call_loader
from pytest_llmload.system.gpus import visible_gpu_count

# torch and transformers are imported by the tests that use them: every pytest run of this repo imports this file at
# collection (`pytest -m gpu` too), and the stack costs seconds there.
TRANSFORMERS_5 = Version(metadata.version("transformers")).major >= 5
needs_no_cuda = pytest.mark.skipif(visible_gpu_count() > 0, reason="a CUDA pin is honoured on this machine")


def raised(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def as_raised_by(library_file: str, exc: BaseException) -> BaseException:
    """``exc`` raised from a frame of ``library_file``, where that library raises it: for a wording this machine's
    stack cannot produce (a CUDA build of torch without a GPU; sentencepiece missing)."""
    code = compile("raise exc", library_file, "exec")
    return raised(lambda: exec(code, {"exc": exc}))


def transformers_file(name: str) -> str:
    import transformers

    return f"{transformers.__path__[0]}/{name}"


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x takes the keyword (with a deprecation warning)")
@pytest.mark.parametrize("keyword, value, fix", [
    ("load_in_8bit", True, REMOVED_KEYWORDS["load_in_8bit"]),
    ("load_in_4bit", True, REMOVED_KEYWORDS["load_in_4bit"]),
    ("use_auth_token", "hf_x", "token=<your token> (or nothing: the saved login is used)"),
])
def test_a_keyword_transformers_5_removed_names_the_version_and_its_replacement(llmload_checkpoint, keyword, value,
                                                                                fix):
    import transformers

    exc = raised(lambda: transformers.AutoModelForCausalLM.from_pretrained(llmload_checkpoint, **{keyword: value}))
    found = diagnose(exc)
    assert found is not None and (found.fault, found.fix) == ("removed keyword", fix), exc
    assert found.cause.startswith(f"{keyword}= is a from_pretrained keyword transformers 5 removed")
    assert f"the installed transformers {transformers.__version__}" in found.cause


def test_both_keyword_styles_at_once_say_keep_the_quantization_config(llmload_checkpoint):
    """longqlora's style: load_in_4bit= beside quantization_config=. 4.x refuses the pair, 5.x the keyword."""
    import transformers

    config = transformers.BitsAndBytesConfig(load_in_4bit=True)
    exc = raised(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        llmload_checkpoint, load_in_4bit=True, quantization_config=config))
    found = diagnose(exc)
    assert found is not None and found.fault == "removed keyword", exc
    assert found.fix.startswith("quantization_config=BitsAndBytesConfig(load_in_4bit=True")
    assert "drop load_in_4bit=" in found.fix  # (it already passes a quantization_config: keep it)


def test_a_second_generation_config_handed_to_transformers_4s_pipeline(llmload_checkpoint):
    """localGPT's style: pipeline(model=..., generation_config=GenerationConfig.from_pretrained(...)); 4.56's pipeline
    passes its own and Python refuses the second (pipelines/base.py); 5.x takes it."""
    import transformers

    message = ("GenerationMixin._prepare_generation_config() got multiple values for keyword argument "
               "'generation_config'")
    if TRANSFORMERS_5:
        exc = as_raised_by(transformers_file("pipelines/base.py"), TypeError(message))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(llmload_checkpoint)
        tokenizer = transformers.AutoTokenizer.from_pretrained(llmload_checkpoint)
        config = transformers.GenerationConfig.from_pretrained(llmload_checkpoint)
        exc = raised(lambda: transformers.pipeline("text-generation", model=model, tokenizer=tokenizer,
                                                   generation_config=config))
    found = diagnose(exc)
    assert found is not None and found.fault == "pipeline keyword", exc
    assert found.fix.startswith("model.generation_config = generation_config")


def test_a_tokenizer_type_the_installed_transformers_does_not_know(llmload_checkpoint):
    """transformers 5 no longer knows "llama" (4.x does: there, a type neither knows raises the same words)."""
    import transformers

    tokenizer_type = "llama" if TRANSFORMERS_5 else "llama_v0"
    exc = raised(lambda: transformers.AutoTokenizer.from_pretrained(llmload_checkpoint, tokenizer_type=tokenizer_type))
    found = diagnose(exc)
    assert found is not None and found.fix.startswith("AutoTokenizer.from_pretrained(path)  # no tokenizer_type"), exc
    assert f"tokenizer_type={tokenizer_type!r}) names a tokenizer type the installed transformers" in found.cause


def _tensor_to_cuda(checkpoint):
    import torch

    return torch.zeros(1).cuda()


def _current_device(checkpoint):
    import torch

    return torch.cuda.current_device()


def _device_map_on_gpu_0(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, device_map={"": 0})


def _device_0(checkpoint):
    import torch

    return torch.device(0)


@needs_no_cuda
@pytest.mark.parametrize("pin", [_tensor_to_cuda, _current_device, _device_map_on_gpu_0, _device_0],
                         ids=[".cuda()", "current_device", "device_map={'': 0}", "torch.device(0)"])
def test_a_cuda_pin_the_runner_cannot_honour_says_why_and_derives_the_device(llmload_checkpoint, pin):
    exc = raised(lambda: pin(llmload_checkpoint))
    found = diagnose(exc)
    assert found is not None and (found.fault, found.fix) == ("device pin", DEVICE_FIX), exc
    assert "pins the model to a CUDA device" in found.cause and "this runner has no GPU" in found.cause or \
        "built without CUDA" in found.cause


@pytest.mark.parametrize("exc, why", [
    (RuntimeError("No CUDA GPUs are available"), "this runner has no CUDA GPU"),
    (AssertionError("Torch not compiled with CUDA enabled"), "the installed torch is built without CUDA"),
    (RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed a "
                  "driver from http://www.nvidia.com/Download/index.aspx"), "this runner has no NVIDIA driver (no GPU)"),
])
def test_torchs_cuda_initialisation_on_a_runner_without_gpus(exc, why):
    import torch

    found = diagnose(as_raised_by(torch.cuda.__file__, exc))
    assert found is not None and found.fault == "device pin" and found.cause.endswith(why)


def test_flash_attention_hard_coded_on_a_runner_without_it_falls_back_to_sdpa(llmload_checkpoint):
    import torch
    import transformers

    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn"):
        pytest.skip("flash-attn runs on this machine")
    exc = raised(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        llmload_checkpoint, attn_implementation="flash_attention_2", torch_dtype=torch.float16))
    found = diagnose(exc)
    assert found is not None and found.fault == "attention kernel", exc
    assert found.fix == ('attn_implementation="flash_attention_2" if importlib.util.find_spec("flash_attn") and '
                         'torch.cuda.is_available() else "sdpa"')
    assert found.cause.startswith("the loader asks for attn_implementation='flash_attention_2', which this runner "
                                  "cannot run (")


def test_a_pad_token_past_the_embedding_rows_says_resize_them():
    import torch

    embeddings = torch.nn.Embedding(8, 2)
    found = diagnose(raised(lambda: embeddings(torch.tensor([[1, 8]]))))  # (8: a pad token added, never resized)
    assert found is not None and (found.fault, found.fix) == ("pad token", PAD_TOKEN_FIX)


def test_a_fault_raised_in_a_child_is_known_by_the_frames_of_its_traceback_text():
    """An exception a child handed back has no traceback of its own: its frames are the child's traceback text."""
    import torch

    import traceback

    embeddings = torch.nn.Embedding(8, 2)
    exc = raised(lambda: embeddings(torch.tensor([[8]])))
    text = "".join(traceback.format_exception(exc))
    back = pickle.loads(pickle.dumps(exc))  # (as it comes back: no __traceback__)
    assert back.__traceback__ is None and diagnose(back) is None
    assert diagnose(back, text).fix == PAD_TOKEN_FIX


def test_a_backward_with_no_gradient_path_says_enable_input_require_grads():
    """torch's own refusal, raised where it raises it (torch.autograd); the LoRA case itself: tests/reports."""
    import torch

    found = diagnose(raised(lambda: (torch.ones(2) * 2).sum().backward()))
    assert found is not None and found.fault == "no gradient path"
    assert found.fix.startswith("model.enable_input_require_grads()")


@pytest.mark.parametrize("backend, package", [("sentencepiece", "sentencepiece"), ("protobuf", "protobuf")])
def test_a_slow_tokenizer_without_its_package_says_install_it_or_use_the_fast_one(monkeypatch, backend, package):
    import transformers

    from transformers.utils import import_utils

    # transformers' own check, as it runs where the package is missing (installed here: its availability is patched)
    monkeypatch.setitem(import_utils.BACKENDS_MAPPING, backend, (lambda: False, import_utils.BACKENDS_MAPPING[backend][1]))
    exc = raised(lambda: import_utils.requires_backends(transformers.LlamaTokenizer, [backend]))
    found = diagnose(exc)
    assert found is not None and found.fault == "tokenizer package", exc
    assert found.fix.startswith(f"pip install {package}  # or AutoTokenizer.from_pretrained(path, use_fast=True)")


def test_a_fast_tokenizer_with_nothing_to_convert_from():
    import transformers

    if TRANSFORMERS_5:
        exc = raised(lambda: transformers.PreTrainedTokenizerFast())
    else:  # (4.x raises it where a slow tokenizer's class exists but could not load: tries tiktoken first here)
        exc = as_raised_by(transformers_file("tokenization_utils_fast.py"), ValueError(
            "Couldn't instantiate the backend tokenizer from one of: \n(1) a `tokenizers` library serialization file, "
            "\n(2) a slow tokenizer instance to convert or \n(3) an equivalent slow tokenizer class to instantiate and "
            "convert. \nYou need to have sentencepiece or tiktoken installed to convert a slow tokenizer to a fast one."))
    found = diagnose(exc)
    assert found is not None and found.fix.startswith("pip install sentencepiece tiktoken"), exc


def test_a_tiktoken_file_without_tiktoken():
    import transformers

    pytest.importorskip("transformers.convert_slow_tokenizer")
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if hasattr(TikTokenConverter, "load_tiktoken_bpe"):  # transformers 5
        exc = raised(lambda: TikTokenConverter.load_tiktoken_bpe("tokenizer.tiktoken"))
    else:  # 4.x
        exc = raised(lambda: TikTokenConverter(vocab_file="x").extract_vocab_merges_from_model("tokenizer.tiktoken"))
    found = diagnose(exc)
    assert found is not None and found.fix.startswith("pip install tiktoken"), exc


def test_transformers_4s_auto_tokenizer_without_sentencepiece():
    exc = as_raised_by(transformers_file("models/auto/tokenization_auto.py"), ValueError(
        "This tokenizer cannot be instantiated. Please make sure you have `sentencepiece` installed in order to use "
        "this tokenizer."))
    assert diagnose(exc).fix.startswith("pip install sentencepiece  #")


def test_a_name_the_loader_binds_only_where_a_gpu_is_says_to_bind_it_before(llmload_checkpoint):
    """qlora's get_accelerate_model: `if torch.cuda.is_available(): n_gpus = ...`, then `range(n_gpus)`."""
    import torch

    from fixtures.corpus import qlora_accelerate_model

    error = raised(lambda: call_loader(qlora_accelerate_model.load, LoadRequest(llmload_checkpoint)))
    assert error.fix == 'n_gpus = ...  # before `if cuda_available:`, its value where no GPU is (0 GPUs, "cpu")', error
    assert error.cause.startswith("the loader binds n_gpus only where a GPU is (`if cuda_available:`, line ")


def _gpus_read_unbound(verbose: bool, gpus_elsewhere: bool):
    import torch

    if verbose:
        n_gpus = 1
    if gpus_elsewhere and torch.cuda.is_available():
        n_gpus = torch.cuda.device_count()
    return n_gpus


@pytest.mark.parametrize("verbose, gpus_elsewhere", [(False, False), (False, True)])
def test_a_name_bound_under_another_if_too_is_the_loaders_own_bug(verbose, gpus_elsewhere):
    assert diagnose(raised(lambda: _gpus_read_unbound(verbose, gpus_elsewhere))) is None


class _Model:
    def __init__(self):
        pass


@pytest.mark.parametrize("call", [
    lambda: _Model(load_in_8bit=True),
    lambda: (_ for _ in ()).throw(IndexError("index out of range in self")),
    lambda: (_ for _ in ()).throw(AssertionError("Torch not compiled with CUDA enabled")),
    lambda: (_ for _ in ()).throw(ImportError("MyTokenizer requires the SentencePiece library but it was not found")),
], ids=["removed keyword", "pad token", "device pin", "tokenizer package"])
def test_the_same_words_from_the_loaders_own_code_are_no_known_fault(call):
    """Known by what raised it, not by wording: the loader's own class refusing a keyword, its own assertion."""
    assert diagnose(raised(call)) is None


@needs_no_cuda
def test_a_fault_the_loader_wrapped_in_its_own_error_is_still_found():
    import torch

    def load():
        try:
            torch.zeros(1, device="cuda")
        except AssertionError as exc:
            raise RuntimeError("could not place the model") from exc

    assert diagnose(raised(load)).fault == "device pin"


@needs_no_cuda
def test_the_loader_error_says_the_cause_and_the_fix_and_keeps_them_across_a_process_boundary(llmload_checkpoint):
    import torch

    error = raised(lambda: call_loader(fault_cuda_current_device.load, LoadRequest(llmload_checkpoint),
                                       loader_name="fixtures.loaders.fault_cuda_current_device:load"))
    assert isinstance(error, LoaderError) and error.fix == DEVICE_FIX
    lines = str(error).splitlines()
    assert lines[0].startswith("loader error: AssertionError: Torch not compiled with CUDA enabled (loader ")
    assert lines[1].startswith("  cause: the loader pins the model to a CUDA device") and lines[2] == f"  fix: {DEVICE_FIX}"
    assert lines[3].startswith("  in the loader's code: load (") and "fault_cuda_current_device.py:" in lines[3]
    assert lines[4] == '    device_map={"": torch.cuda.current_device()})'  # the loader's line: what to change
    back = pickle.loads(pickle.dumps(error))  # (an isolated check's child hands it back so)
    assert (type(back), back.fix, back.cause, str(back)) == (LoaderError, error.fix, error.cause, str(error))


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x takes the keywords")
def test_transformers_4s_keywords_on_transformers_5_are_a_loader_error_with_the_replacement(llmload_checkpoint):
    error = raised(lambda: call_loader(fault_transformers4_keywords.load, LoadRequest(llmload_checkpoint)))
    assert error.fix == REMOVED_KEYWORDS["load_in_8bit"], error
    # the loader's statement whole, written over three lines: the keyword to change is on the last
    assert str(error).endswith('\n    model = AutoModelForCausalLM.from_pretrained(\n    '
                               '    request.model_path, local_files_only=True, torch_dtype=request.torch_dtype, '
                               'max_memory=request.max_memory,\n        device_map="auto" if request.max_memory else '
                               '{"": request.device}, offload_folder=request.offload_folder,\n        load_in_8bit='
                               'request.quantization == "8bit", load_in_4bit=request.quantization == "4bit")'), error


def test_the_loaders_code_is_the_loaders_frames_never_this_plugins_spy(tmp_path):
    """Before: the check's own spy (instruments/probes.py, as failures/adapter_on_offloaded.py:173 was) was named as
    the loader's code, being outside installed libraries."""
    from transformers import GenerationConfig

    from pytest_llmload.instruments.probes import spy_classmethod

    def load(request):
        return GenerationConfig.from_pretrained(tmp_path / "no-such-model", local_files_only=True)

    with spy_classmethod(GenerationConfig, "from_pretrained", []):
        error = raised(lambda: call_loader(load, LoadRequest(tmp_path)))
    where = str(error).partition("in the loader's code: ")[2]
    assert where.startswith("load (") and __file__ in where and "pytest_llmload" not in where, str(error)


def test_a_compile_cache_directory_torch_could_not_make_is_named_with_what_to_set(tmp_path, monkeypatch):
    """Issue 49, point 7: a second import of torch._inductor after its first could not make the cache directory says
    only "Artifact of type=precompile already registered": the directory, why, and the variable to set."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # (what torch._inductor's cache_dir() leaves in the environment before it makes the directory, and fails)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "torchinductor"))
    torch_folder = importlib.util.find_spec("torch").submodule_search_locations[0]  # (torch not imported)
    cache_module = f"{torch_folder}/compiler/_cache.py"
    exc = AssertionError("Artifact of type=precompile already registered in mega-cache artifact factory")
    found = diagnose(as_raised_by(cache_module, exc))
    cause = (f"torch's compile cache directory {str(blocker / 'torchinductor')!r} is a file, not a directory: "
             "torch._inductor's import fails making it (and every later import says only that a cache type is "
             "already registered)")
    assert (found.cause, found.fix) == (cause, COMPILE_CACHE_FIX)
    assert COMPILE_CACHE_FIX.startswith("export TORCHINDUCTOR_CACHE_DIR=<a directory this job can write>")
    assert diagnose(AssertionError(str(exc))) is None  # (the same words from the loader's own code: nothing known)
    # The first import's own error, raised making the directory
    first = NotADirectoryError(20, "Not a directory", str(blocker / "torchinductor"))
    assert diagnose(as_raised_by(f"{torch_folder}/_inductor/runtime/cache_dir_utils.py", first)).cause == cause
