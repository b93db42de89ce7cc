"""Memory savers for training on small accelerators: block swap and the fused backward pass."""
