"""Model code: the Llama-family forward pass, its configuration and the weight loaders."""
