"""When each action runs: the dependency rules, the in-order run of every rank's list (and its
rerun), a compute-only schedule's timeline, and arithmetic on time intervals."""
