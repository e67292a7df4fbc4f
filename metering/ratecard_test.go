package metering_test

import (
	"math"
	"math/big"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/metering"
)

func defaultCard(t testing.TB) *metering.RateCard {
	t.Helper()
	rc, err := metering.NewRateCard(map[gateway.Model]string{"instant": "1", "reasoning": "4", "elements": "2"}, "0.5")
	require.NoError(t, err)
	return rc
}

func TestPrice(t *testing.T) {
	t.Parallel()
	rc := defaultCard(t)
	tests := []struct {
		model  gateway.Model
		entry  gateway.EntryPoint
		tokens uint64
		want   int64
	}{
		{gateway.ModelInstant, gateway.EntryResponses, 0, 0},
		{gateway.ModelInstant, gateway.EntryResponses, 7, 7},
		{gateway.ModelReasoning, gateway.EntryChat, 7, 28},
		{gateway.ModelElements, gateway.EntryResponses, 7, 14},
		{gateway.ModelInstant, gateway.EntryBatch, 7, 4},    // ceil(3.5)
		{gateway.ModelReasoning, gateway.EntryBatch, 7, 14}, // 7×4×0.5
		{gateway.ModelElements, gateway.EntryBatch, 1, 1},
	}
	for _, tt := range tests {
		got, err := rc.Price(tt.model, tt.entry, tt.tokens)
		require.NoError(t, err)
		require.Equal(t, tt.want, got, "%s %s %d", tt.model, tt.entry, tt.tokens)
	}
}

func TestPriceIsExactForDecimals(t *testing.T) {
	t.Parallel()
	// 0.1 × 3 is 0.30000000000000004 in floating point, which would round up to 1.
	rc, err := metering.NewRateCard(map[gateway.Model]string{"instant": "0.1", "reasoning": "1", "elements": "1"}, "0")
	require.NoError(t, err)
	got, err := rc.Price(gateway.ModelInstant, gateway.EntryResponses, 30)
	require.NoError(t, err)
	require.Equal(t, int64(3), got)
}

// TestPriceOfAModelNotOnTheCard: a model the card has no multiplier for is
// refused, never priced at nothing.
func TestPriceOfAModelNotOnTheCard(t *testing.T) {
	t.Parallel()
	for _, entry := range []gateway.EntryPoint{gateway.EntryResponses, gateway.EntryBatch} {
		_, err := defaultCard(t).Price("gpt-9", entry, 7)
		require.ErrorContains(t, err, `no rate for model "gpt-9"`, entry)
	}
}

func TestUsageSumsSides(t *testing.T) {
	t.Parallel()
	u, err := defaultCard(t).Usage(gateway.ModelInstant, gateway.EntryBatch, 3, 5)
	require.NoError(t, err)
	require.Equal(t, gateway.Usage{InputTokens: 3, OutputTokens: 5, InputRungs: 2, OutputRungs: 3, TotalRungs: 5}, u)
}

func TestPriceOverflowIsRejected(t *testing.T) {
	t.Parallel()
	rc := defaultCard(t)
	_, err := rc.Price(gateway.ModelReasoning, gateway.EntryResponses, math.MaxUint64)
	require.ErrorIs(t, err, metering.ErrOverflow)
	_, err = rc.Usage(gateway.ModelInstant, gateway.EntryResponses, math.MaxInt64, 1)
	require.ErrorIs(t, err, metering.ErrOverflow)
	_, err = rc.Usage(gateway.ModelReasoning, gateway.EntryResponses, math.MaxInt64/2, 1)
	require.ErrorIs(t, err, metering.ErrOverflow, "an input that does not price")
	u, err := rc.Usage(gateway.ModelInstant, gateway.EntryResponses, math.MaxInt64-5, 5)
	require.NoError(t, err, "a total of exactly the largest int64 fits")
	require.Equal(t, int64(math.MaxInt64), u.TotalRungs)
	// Counts past int64 that price at nothing do not fit the usage either.
	free, err := metering.NewRateCard(map[gateway.Model]string{"instant": "0", "reasoning": "0", "elements": "0"}, "0")
	require.NoError(t, err)
	for _, tokens := range [][2]uint64{{math.MaxInt64 + 1, 0}, {0, math.MaxInt64 + 1}} {
		_, err = free.Usage(gateway.ModelInstant, gateway.EntryResponses, tokens[0], tokens[1])
		require.ErrorIs(t, err, metering.ErrOverflow, "%v", tokens)
	}
}

// TestNewRateCardChecksItsInput: a discount outside [0, 1], a model without
// its multiplier or a negative one is refused; the discount's bounds are in.
func TestNewRateCardChecksItsInput(t *testing.T) {
	t.Parallel()
	ok := map[gateway.Model]string{"instant": "1", "reasoning": "4", "elements": "2"}
	for _, d := range []string{"-0.1", "1.5", "x", ""} {
		_, err := metering.NewRateCard(ok, d)
		require.Error(t, err, d)
	}
	_, err := metering.NewRateCard(map[gateway.Model]string{"instant": "1"}, "0.5")
	require.ErrorContains(t, err, "no rung multiplier for model reasoning")
	// The bounds are in: no discount, and batch items for nothing.
	for d, rungs := range map[string]int64{"0": 7, "1": 0} {
		rc, err := metering.NewRateCard(ok, d)
		require.NoError(t, err, d)
		price, err := rc.Price(gateway.ModelInstant, gateway.EntryBatch, 7)
		require.NoError(t, err)
		require.Equal(t, rungs, price, "discount %s", d)
	}
	_, err = metering.NewRateCard(map[gateway.Model]string{"instant": "-1", "reasoning": "4", "elements": "2"}, "0.5")
	require.Error(t, err)
}

// FuzzPrice checks the defining property of the price: the smallest integer not
// below tokens × m × d, or a clean overflow error, never a wrapped value.
func FuzzPrice(f *testing.F) {
	f.Add(uint64(7), "4", "0.5", true)
	f.Add(uint64(math.MaxUint64), "4", "0", false)
	f.Add(uint64(1<<62), "2.5", "0.25", true)
	f.Fuzz(func(t *testing.T, tokens uint64, mult, discount string, batch bool) {
		rc, err := metering.NewRateCard(map[gateway.Model]string{"instant": mult, "reasoning": "1", "elements": "1"}, discount)
		if err != nil {
			return
		}
		entry := gateway.EntryResponses
		factor, _ := new(big.Rat).SetString(mult)
		if batch {
			entry = gateway.EntryBatch
			d, _ := new(big.Rat).SetString(discount)
			factor.Mul(factor, new(big.Rat).Sub(big.NewRat(1, 1), d))
		}
		exact := new(big.Rat).Mul(new(big.Rat).SetInt(new(big.Int).SetUint64(tokens)), factor)
		got, err := rc.Price(gateway.ModelInstant, entry, tokens)
		if err != nil {
			require.ErrorIs(t, err, metering.ErrOverflow)
			require.Equal(t, 1, exact.Cmp(new(big.Rat).SetInt64(math.MaxInt64)), "overflow reported for a price that fits")
			return
		}
		require.GreaterOrEqual(t, got, int64(0))
		g := new(big.Rat).SetInt64(got)
		require.True(t, g.Cmp(exact) >= 0, "price %d below exact %s", got, exact.FloatString(3))
		require.True(t, new(big.Rat).Sub(g, big.NewRat(1, 1)).Cmp(exact) < 0, "price %d not the ceiling of %s", got, exact.FloatString(3))
	})
}

func TestEstimate(t *testing.T) {
	t.Parallel()
	tok, err := metering.DefaultTokenizer()
	require.NoError(t, err)
	est := &metering.Estimator{Tokenizer: tok, RateCard: defaultCard(t)}
	req := gateway.Request{Prompt: "Hello, world! How are you today?", CustomInstructions: "Be brief.", Model: gateway.ModelReasoning, MaxOutputRungs: 100}
	e, err := est.Estimate(req, gateway.EntryResponses)
	require.NoError(t, err)
	require.Equal(t, tok.Count(req.Prompt)+tok.Count(req.CustomInstructions), e.InputTokens)
	require.Less(t, e.InputTokens, uint64(len(req.Prompt)+len(req.CustomInstructions)), "a real tokenizer counts fewer tokens than bytes")
	require.Equal(t, int64(e.InputTokens)*4, e.InputRungs)
	require.Equal(t, int64(400), e.OutputRungs)
	require.Equal(t, e.InputRungs+400, e.Total())
}
