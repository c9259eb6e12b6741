"""Structure: the units of a model (filters, neurons) as every sparse method sees them, and what they cost.

Owns `unit_masks` (one mask a unit, multiplying its output; the weights a sub-model consists of),
`unit_selection` (keeping the top-scored units, by layer or residual group), `layer_groups` (a model's layers and
their parameters as FedLDF moves them), `model_parts` (encoder, predictor and other parts as nested dicts) and
`flops` (FLOPs from the structure every model describes, and measured from its forward pass).

May import: models and data only; every other room builds on it.
"""
