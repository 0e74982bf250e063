"""rksc_integrations: the LangChain and LlamaIndex adapters."""
