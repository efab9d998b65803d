"""What a run says: verdicts, report sections, the progress file, the known-failure section, the HTML report."""
