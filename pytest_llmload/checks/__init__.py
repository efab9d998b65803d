"""The check framework, knowing no specific failure: the records a failure is made of, the contract every check loads
through, and the ground truth the checks share."""
