"""Constrained decoding on the scheduler's side: the compiled `Grammar` a request carries,
the matchers of the constrained sequences, and the bitmasks a step hands the runner."""
