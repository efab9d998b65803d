"""What the plugin tells about a run: phase timings with memory (:mod:`.phases`, :mod:`.memory_probe`), where a
model's weights are (:mod:`.device_map_summary`), the ``limit_torch_memory`` marker (:mod:`.memory_limit`), the
report sections and session summary (:mod:`.report`), and known failures named in failing tests
(:mod:`.known_failures`)."""
