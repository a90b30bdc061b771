"""Tensor-parallel state and collectives (torch.distributed)."""
