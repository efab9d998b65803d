"""The check framework, knowing no specific failure: records, the contract, ground truth, the row."""
