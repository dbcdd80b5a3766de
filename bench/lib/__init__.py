"""What the bench scripts share: timing, the roofline floor, case builders, the result schema, plots."""
