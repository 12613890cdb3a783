"""The model executor both node kinds run: Llama model, attention backends, block pool and prefix cache, scheduler, sampler. Knows nothing about HTTP, Redis or the network."""
