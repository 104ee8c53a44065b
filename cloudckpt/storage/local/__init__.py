"""``LocalStore``: objects as files under a root (``store``), its file steps and the one local
atomic write (``files``), listings (``listing``) and the path jail nothing escapes (``paths``)."""
