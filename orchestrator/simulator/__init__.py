"""The goodput simulator: failures at millions of chips, with the same quorum and grace policies as real runs."""
