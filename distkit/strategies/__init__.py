"""Data-parallel backends. Each module is imported only when its strategy is chosen."""
