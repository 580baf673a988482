"""Every call to the upstream `llm_endpoint.base_url` and the header filter for calls made for a client."""
