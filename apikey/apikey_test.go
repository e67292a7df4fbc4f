package apikey_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/apikey"
)

func TestGenerateParseHash(t *testing.T) {
	t.Parallel()
	k, err := apikey.Generate()
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(k.Token, "igw_"))
	require.Len(t, k.Token, 56)
	require.Equal(t, k.Token[:12], k.Prefix)

	prefix, err := apikey.Parse(k.Token)
	require.NoError(t, err)
	require.Equal(t, k.Prefix, prefix)
	require.Equal(t, apikey.Hash(k.Token), k.Hash)
	require.NotContains(t, string(k.Hash), k.Token)

	other, err := apikey.Generate()
	require.NoError(t, err)
	require.NotEqual(t, k.Token, other.Token)
	require.NotEqual(t, apikey.Hash(other.Token), k.Hash)
}

func TestParseRejectsMalformed(t *testing.T) {
	t.Parallel()
	k, err := apikey.Generate()
	require.NoError(t, err)
	for _, bad := range []string{"", "igw_", "sk-" + k.Token[4:], k.Token + "a", k.Token[:55], k.Token[:20] + "!" + k.Token[21:], strings.ToUpper(k.Token)} {
		_, err := apikey.Parse(bad)
		require.ErrorIs(t, err, apikey.ErrMalformed, bad)
	}
}
