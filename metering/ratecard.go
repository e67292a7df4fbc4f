// Package metering prices requests in rungs: the rate card (per-model multipliers
// and the batch discount) and token estimates made with a real tokenizer.
package metering

import (
	"errors"
	"fmt"
	"math"
	"math/big"

	"github.com/rungworks/gateway"
)

// ErrOverflow is returned when a price does not fit in a signed 64-bit integer.
var ErrOverflow = errors.New("rung count overflows int64")

// RateCard prices tokens in rungs: rungs = ceil(tokens × m × d), where m is the
// model's multiplier and d is 1 − discount for batch items, 1 otherwise. All
// arithmetic is exact (rational), so no float rounding can under- or over-bill.
type RateCard struct {
	interactive map[gateway.Model]*big.Rat // m
	batch       map[gateway.Model]*big.Rat // m × (1 − discount)
}

// NewRateCard builds a rate card from decimal multipliers per model (every
// canonical model needs one, at least 0) and a batch discount in [0, 1].
func NewRateCard(multipliers map[gateway.Model]string, batchDiscount string) (*RateCard, error) {
	d, ok := new(big.Rat).SetString(batchDiscount)
	if !ok || d.Sign() < 0 || d.Cmp(big.NewRat(1, 1)) > 0 {
		return nil, fmt.Errorf("batch discount %q must be a decimal between 0 and 1", batchDiscount)
	}
	keep := new(big.Rat).Sub(big.NewRat(1, 1), d)
	rc := &RateCard{interactive: map[gateway.Model]*big.Rat{}, batch: map[gateway.Model]*big.Rat{}}
	for _, model := range gateway.Models {
		s, ok := multipliers[model]
		if !ok {
			return nil, fmt.Errorf("no rung multiplier for model %s", model)
		}
		m, ok := new(big.Rat).SetString(s)
		if !ok || m.Sign() < 0 {
			return nil, fmt.Errorf("rung multiplier %q of model %s must be a non-negative decimal", s, model)
		}
		rc.interactive[model] = m
		rc.batch[model] = new(big.Rat).Mul(m, keep)
	}
	return rc, nil
}

// Price returns ceil(tokens × m × d) for the model and entry point.
func (rc *RateCard) Price(model gateway.Model, entry gateway.EntryPoint, tokens uint64) (int64, error) {
	factor := rc.interactive[model]
	if entry == gateway.EntryBatch {
		factor = rc.batch[model]
	}
	if factor == nil {
		return 0, fmt.Errorf("no rate for model %q", model)
	}
	num := new(big.Int).Mul(new(big.Int).SetUint64(tokens), factor.Num())
	q, r := new(big.Int).QuoRem(num, factor.Denom(), new(big.Int))
	if r.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	if !q.IsInt64() {
		return 0, ErrOverflow
	}
	return q.Int64(), nil
}

// Usage prices input and output token counts as D5 says: each side rounded up,
// the total their sum.
func (rc *RateCard) Usage(model gateway.Model, entry gateway.EntryPoint, inputTokens, outputTokens uint64) (gateway.Usage, error) {
	in, err := rc.Price(model, entry, inputTokens)
	if err != nil {
		return gateway.Usage{}, fmt.Errorf("error pricing input tokens: %w", err)
	}
	out, err := rc.Price(model, entry, outputTokens)
	if err != nil {
		return gateway.Usage{}, fmt.Errorf("error pricing output tokens: %w", err)
	}
	if in > math.MaxInt64-out || inputTokens > math.MaxInt64 || outputTokens > math.MaxInt64 {
		return gateway.Usage{}, ErrOverflow
	}
	return gateway.Usage{
		InputTokens:  int64(inputTokens),
		OutputTokens: int64(outputTokens),
		InputRungs:   in,
		OutputRungs:  out,
		TotalRungs:   in + out,
	}, nil
}
