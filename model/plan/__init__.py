"""What this process runs (model/plan/kernel_plan.py), decided once at start-up."""
