"""Speculative decoding on the scheduler's side: the configuration, each sequence's guesses
(n-gram lookup, or slots for the runner's draft model), how far each guesses, and what a
guess costs."""
