"""Checks a job plan can run before any process starts."""


def check_ep_degree(n_experts: int, ep: int) -> None:
    """ValueError (one line, naming the numbers) unless ``ep`` ranks can each hold the same
    number of whole experts: ``ep >= 1`` and ``n_experts`` divisible by ``ep``."""
    if ep < 1:
        raise ValueError(f"expert parallel degree {ep} must be >= 1")
    if n_experts % ep:
        raise ValueError(f"{n_experts} experts do not divide over expert parallel degree {ep}")
