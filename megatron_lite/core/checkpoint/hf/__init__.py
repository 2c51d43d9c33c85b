"""Hugging Face interop: ``config.json`` <-> GPTConfig (``config``), HF tensor names and layouts <-> our full state
(``weights``), and reading and writing HF model directories (``directory``)."""
