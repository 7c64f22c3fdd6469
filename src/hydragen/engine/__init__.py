"""Engine: requests, sampling, the decode batch and the offline LLM API."""
