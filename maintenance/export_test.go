package maintenance

// BatchRows is how many rows make a run full: a backlog is left.
const BatchRows = batchRows
