"""What a weight format is: the linear layers that hold a checkpoint's bits, each handed
its kernel when built (model/plan/ chooses it; nothing here imports the plan)."""
