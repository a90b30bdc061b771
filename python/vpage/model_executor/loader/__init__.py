"""Finding model files and reading their weights (Hugging Face folders and GGUF files)."""
