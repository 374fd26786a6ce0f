"""The evaluation harness: retrieval as in CacheBlend, methods, metrics, reports, insight figures, datasets."""
