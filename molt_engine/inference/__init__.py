"""Inference: the sampler that decodes every episode's tokens, in the loop's process or a child of its own."""
