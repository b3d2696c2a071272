"""The planning wing: where each subgroup's Adam state is updated (``plan="auto"``)."""
