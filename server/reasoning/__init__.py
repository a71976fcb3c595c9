"""Reasoning output: splitting what a model writes inside its think block from its answer,
which parser a chat template calls for, and the grammar prefix that leaves the think block
free when an answer is constrained."""
