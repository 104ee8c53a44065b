"""Save planning, pure: each rank's local plan and its codec, the global plan every rank
computes alike (``global_plan``), who writes replicated boxes (``replicas``), the plan cache, the
manifest assembled from the ranks' reports, and which chunks an incremental save reuses."""
