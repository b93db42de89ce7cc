"""The family contract: every registered family, through the CLI and the Family protocol."""
