"""Model shapes: presets and model files → cache specs."""
