"""The logic behind the tabs: plain Python, testable without a browser."""
