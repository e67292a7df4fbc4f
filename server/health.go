package server

import (
	"context"

	"github.com/rungworks/gateway/gen/api"
)

// GetHealth implements GET /healthz: the process answers.
func (s *Server) GetHealth(context.Context, api.GetHealthRequestObject) (api.GetHealthResponseObject, error) {
	return api.GetHealth200JSONResponse{Status: api.Ok}, nil
}

// GetReadiness implements GET /readyz: the database answers with a current
// schema, and the replica is not shutting down.
func (s *Server) GetReadiness(ctx context.Context, _ api.GetReadinessRequestObject) (api.GetReadinessResponseObject, error) {
	if s.draining.Load() {
		detail := "shutting down"
		return api.GetReadiness503JSONResponse{Status: api.Unavailable, Detail: &detail}, nil
	}
	ctx, cancel := waitForDatabase(ctx)
	defer cancel()
	if err := s.ready.Ready(ctx); err != nil {
		detail := err.Error()
		return api.GetReadiness503JSONResponse{Status: api.Unavailable, Detail: &detail}, nil
	}
	return api.GetReadiness200JSONResponse{Status: api.Ok}, nil
}

// Drain marks the replica as shutting down: /readyz answers 503 from now on,
// so load balancers stop sending it requests.
func (s *Server) Drain() { s.draining.Store(true) }
