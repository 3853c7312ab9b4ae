"""AutoCompress: hardware-guided compression of LLMs, with the deployment as the objective."""

__version__ = "0.1.0"
