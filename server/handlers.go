package server

import (
	"context"
	"time"

	"github.com/google/uuid"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/gen/api"
	"github.com/rungworks/gateway/inference"
)

var _ api.StrictServerInterface = (*Server)(nil)

// CreateResponse implements POST /api/v1/responses.
func (s *Server) CreateResponse(ctx context.Context, req api.CreateResponseRequestObject) (api.CreateResponseResponseObject, error) {
	if isStream(req.Body) {
		reply, err := s.stream(ctx, gateway.EntryResponses, req.Body)
		if err != nil {
			return nil, err
		}
		return reply, nil
	}
	reply, err := s.respond(ctx, gateway.EntryResponses, req.Body)
	if err != nil {
		return nil, err
	}
	return api.CreateResponse200JSONResponse{ResponseCreatedJSONResponse: reply}, nil
}

// CreateChat implements POST /api/v1/chat, the compatibility alias.
func (s *Server) CreateChat(ctx context.Context, req api.CreateChatRequestObject) (api.CreateChatResponseObject, error) {
	if isStream(req.Body) {
		reply, err := s.stream(ctx, gateway.EntryChat, req.Body)
		if err != nil {
			return nil, err
		}
		return reply, nil
	}
	reply, err := s.respond(ctx, gateway.EntryChat, req.Body)
	if err != nil {
		return nil, err
	}
	return api.CreateChat200JSONResponse{ResponseCreatedJSONResponse: reply}, nil
}

func isStream(body *api.ResponseRequest) bool { return body.Stream != nil && *body.Stream }

func (s *Server) respond(ctx context.Context, entry gateway.EntryPoint, body *api.ResponseRequest) (api.ResponseCreatedJSONResponse, error) {
	ctx, done := s.callContext(ctx)
	defer done()
	call, err := s.admit(ctx, entry, body)
	if err != nil {
		return api.ResponseCreatedJSONResponse{}, err
	}
	res, err := s.inference.Complete(ctx, call)
	if err != nil {
		return api.ResponseCreatedJSONResponse{}, err
	}
	noteBilled(ctx, res)
	return api.ResponseCreatedJSONResponse{
		Body: responseBody(res),
		Headers: api.ResponseCreatedResponseHeaders{
			XServiceInputRungs:  &res.Usage.InputRungs,
			XServiceOutputRungs: &res.Usage.OutputRungs,
			XServiceTotalRungs:  &res.Usage.TotalRungs,
		},
	}, nil
}

// admit prepares a request (rate limit, validation, routing, estimate) and
// admits it (daily charge, budget reservation). A call refused at admission is
// returned with the error, for a stream to report its estimate.
func (s *Server) admit(ctx context.Context, entry gateway.EntryPoint, body *api.ResponseRequest) (*inference.Call, error) {
	call, err := s.prepare(ctx, entry, requestInput(body, misplacedText(ctx, 0)))
	if err != nil {
		return nil, err
	}
	if id, ok := generatedRequestID(ctx); ok {
		call.RequestID = id
	}
	return call, s.inference.Admit(ctx, call)
}

// prepare prepares a request; one whose text is over turnFreeBytes, within
// its key's rate, is priced in its account's turn (takeTurn), which it waits
// for once its body is read: a response's body is at most 1 MiB, and a
// stream can only be refused as a stream once the body says it is one.
func (s *Server) prepare(ctx context.Context, entry gateway.EntryPoint, in gateway.RequestInput) (*inference.Call, error) {
	p := gateway.PrincipalFrom(ctx)
	if p.Rate.Admitted && len(in.Prompt)+len(in.CustomInstructions) > turnFreeBytes {
		leave, err := s.enterTurn(ctx)
		if err != nil {
			return nil, err
		}
		defer leave()
	}
	return s.inference.Prepare(p, entry, in)
}

// stream prepares a streamed request; whatever fails from here on is reported
// inside the stream, after its 200 head, but a failure as its client left
// (failedAsClientLeft), which is not answered: handleError's, as a JSON
// request's.
func (s *Server) stream(ctx context.Context, entry gateway.EntryPoint, body *api.ResponseRequest) (streamReply, error) {
	callCtx, done := s.callContext(ctx)
	call, err := s.admit(callCtx, entry, body)
	if err != nil && failedAsClientLeft(ctx, err) {
		done()
		return streamReply{}, err
	}
	return streamReply{s: s, ctx: callCtx, done: done, call: call, err: err}, nil
}

// GetSources implements GET /api/v1/sources/{request_id}.
func (s *Server) GetSources(ctx context.Context, req api.GetSourcesRequestObject) (api.GetSourcesResponseObject, error) {
	reply, err := s.sources(ctx, req.RequestId)
	if err != nil {
		return nil, err
	}
	return api.GetSources200JSONResponse{SourcesFoundJSONResponse: reply}, nil
}

// GetResponseSources implements GET /api/v1/responses/{request_id}/sources, the
// compatibility alias.
func (s *Server) GetResponseSources(ctx context.Context, req api.GetResponseSourcesRequestObject) (api.GetResponseSourcesResponseObject, error) {
	reply, err := s.sources(ctx, req.RequestId)
	if err != nil {
		return nil, err
	}
	return api.GetResponseSources200JSONResponse{SourcesFoundJSONResponse: reply}, nil
}

func (s *Server) sources(ctx context.Context, rawID string) (api.SourcesFoundJSONResponse, error) {
	id, err := uuid.Parse(rawID)
	if err != nil {
		return api.SourcesFoundJSONResponse{}, gateway.Errorf(gateway.ESourcesNotFound, "no evidence is held for request %s", gateway.Quote(rawID))
	}
	ctx, cancel := waitForDatabase(ctx)
	defer cancel()
	ev, err := s.evidence.Evidence(ctx, gateway.PrincipalFrom(ctx).AccountID, id)
	if err != nil {
		return api.SourcesFoundJSONResponse{}, err
	}
	body := api.Sources{RequestId: ev.RequestID, Sources: apiSources(ev.Sources)}
	if ev.Verdict != "" {
		body.EvidenceVerdict = &ev.Verdict
	}
	return api.SourcesFoundJSONResponse{Body: body}, nil
}

// GetUsage implements GET /api/v1/usage: [start, end), by default the current
// UTC day. Times are cut to the microsecond, the precision of the times usage
// is stored with, so the period the reply names is the one counted.
func (s *Server) GetUsage(ctx context.Context, req api.GetUsageRequestObject) (api.GetUsageResponseObject, error) {
	start := gateway.UTCDay(time.Now())
	end := start.Add(24 * time.Hour)
	if req.Params.Start != nil {
		start = req.Params.Start.UTC().Truncate(time.Microsecond)
	}
	if req.Params.End != nil {
		end = req.Params.End.UTC().Truncate(time.Microsecond)
	}
	if !start.Before(end) {
		return nil, gateway.Errorf(gateway.EInvalidRequest, "start must be before end (to the microsecond)")
	}
	if err := gateway.CheckUsagePeriod(start, end, time.Now(), s.requestRetention); err != nil {
		return nil, err
	}
	ctx, cancel := waitForDatabase(ctx)
	defer cancel()
	v, err := s.usage.Usage(ctx, gateway.PrincipalFrom(ctx), start, end)
	if err != nil {
		return nil, err
	}
	byModel := make([]api.ModelUsage, len(v.ByModel))
	for i, m := range v.ByModel {
		byModel[i] = api.ModelUsage{Model: api.ModelUsageModel(m.Model), Requests: m.Requests, InputRungs: m.InputRungs, OutputRungs: m.OutputRungs, TotalRungs: m.TotalRungs}
	}
	body := api.UsageView{
		Totals:  api.UsageTotals{Requests: v.Totals.Requests, InputRungs: v.Totals.InputRungs, OutputRungs: v.Totals.OutputRungs, TotalRungs: v.Totals.TotalRungs},
		ByModel: byModel,
	}
	body.Period.Start, body.Period.End = v.Start, v.End
	body.Daily.CeilingRungs, body.Daily.ChargedRungs, body.Daily.RemainingRungs, body.Daily.ResetsAt = v.Daily.Ceiling, v.Daily.Charged, v.Daily.Remaining, v.Daily.ResetsAt
	body.Budget.Project, body.Budget.CapRungs, body.Budget.SpentRungs, body.Budget.ReservedRungs = v.Budget.Project, v.Budget.Cap, v.Budget.Spent, v.Budget.Reserved
	return api.GetUsage200JSONResponse{Body: body}, nil
}

// GetOpenAPI implements GET /openapi.json.
func (s *Server) GetOpenAPI(_ context.Context, req api.GetOpenAPIRequestObject) (api.GetOpenAPIResponseObject, error) {
	return s.openAPI.reply(req.Params.IfNoneMatch), nil
}

// GetJSONSchema implements GET /api/schema.json.
func (s *Server) GetJSONSchema(_ context.Context, req api.GetJSONSchemaRequestObject) (api.GetJSONSchemaResponseObject, error) {
	return s.schema.reply(req.Params.IfNoneMatch), nil
}

// requestInput is the request b; misplaced, the field of another API's
// request shape that holds its text (see noteMisplacedText), if any.
func requestInput(b *api.ResponseRequest, misplaced string) gateway.RequestInput {
	in := gateway.RequestInput{
		Prompt:         b.Prompt,
		Misplaced:      misplaced,
		Model:          b.Model,
		MaxOutputRungs: b.MaxOutputRungs,
		IncludeRegions: deref(b.IncludeRegions),
		Hints: gateway.Hints{
			WebSearch: deref(b.WebSearch),
			CodeMode:  deref(b.CodeMode),
			ImageMode: deref(b.ImageMode),
		},
	}
	if b.CustomInstructions != nil {
		in.CustomInstructions = *b.CustomInstructions
	}
	if b.StudioId != nil {
		in.StudioID = *b.StudioId
	}
	return in
}

func responseBody(res *inference.Result) api.Response {
	body := api.Response{
		RequestId:  res.RequestID,
		Content:    res.Content,
		Sources:    apiSources(res.Sources),
		SourcesUrl: "/api/v1/sources/" + res.RequestID.String(),
		Model:      api.ResponseModel(res.Model),
		Usage: api.Usage{
			InputRungs:       res.Usage.InputRungs,
			OutputRungs:      res.Usage.OutputRungs,
			TotalRungs:       res.Usage.TotalRungs,
			RegionsActivated: res.RegionsActivated,
		},
		Route: &api.RouteInfo{
			RouteId:            res.Route.ID,
			SelectedEntryPoint: api.RouteInfoSelectedEntryPoint(res.Route.Entry),
			PrimaryModel:       api.RouteInfoPrimaryModel(res.Route.Primary),
			RouteClass:         api.Auto,
			DecidedAtNs:        res.Route.DecidedAt.UnixNano(),
			DecidedAt:          res.Route.DecidedAt.UTC(),
		},
	}
	if res.Route.Explicit {
		body.Route.RouteClass = api.Explicit
	}
	if res.Route.EvidenceModel != "" {
		m := api.RouteInfoEvidenceModel(res.Route.EvidenceModel)
		body.Route.EvidenceModel = &m
	}
	if u := res.Route.Upstream; u.Provider != "" {
		body.Route.Provider, body.Route.UpstreamModel, body.Route.Attempts = &u.Provider, &u.UpstreamModel, &u.Attempts
	}
	if res.Verdict != "" {
		body.EvidenceVerdict = &res.Verdict
	}
	return body
}

// apiSources converts evidence to the wire form; never nil, so the required
// array is [] rather than null.
func apiSources(in []gateway.Source) []api.Source {
	out := make([]api.Source, len(in))
	for i, src := range in {
		out[i] = api.Source{Title: src.Title, Url: src.URL}
		if src.Snippet != "" {
			out[i].Snippet = &src.Snippet
		}
	}
	return out
}

func deref(b *bool) bool { return b != nil && *b }
