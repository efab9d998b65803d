"""What a run says: the one row record, verdicts, report sections, the progress file, the known-failure section, the HTML
report, the header, and the rows in JUnit XML and pytest-reportlog files."""
