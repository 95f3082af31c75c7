"""The fused steps: their torch.library ops, plans read from declared transforms, and the update built on them."""
