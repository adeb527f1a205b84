"""Measurement: offline method comparisons (`offline`), load tests through the scheduler (`load`) or
over HTTP (`http`), the verify window's cost profile, and the prompt sets they read."""
