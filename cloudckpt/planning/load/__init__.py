"""Load planning, pure: a rank's read items over a manifest (``plan``, its codec
``plan_codec``), the chunk index behind them, read windows of a region (``windows``,
``windows_many``) and the hints about names a load asks for and a checkpoint holds."""
