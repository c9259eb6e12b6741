"""The engine: algorithm contract, local training, rounds, aggregation, bytes, evaluation."""
