package controlplane

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/controlplane/api"
	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/controlplane/rollout"
	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/policy"
)

// operator implements the operator API over the control plane.
type operator struct{ s *Server }

var _ api.Backend = operator{}

// apiErr translates the registry's errors into the API's.
func apiErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, registry.ErrNotFound):
		return fmt.Errorf("%w: %w", api.ErrNotFound, err)
	case errors.Is(err, registry.ErrInvalid):
		return fmt.Errorf("%w: %w", api.ErrInvalid, err)
	case errors.Is(err, registry.ErrNotRemovable), errors.Is(err, registry.ErrVersionConflict):
		return fmt.Errorf("%w: %w", api.ErrConflict, err)
	}
	return err
}

func (o operator) worker(w registry.Worker) *operatorv1.Worker {
	s := o.s
	st, _ := s.view.Get(w.ID)
	slot, _ := s.index.SlotOf(w.ID) // a view: the slot is given by reconcile, not here
	b := s.index.Blocks(w.ID)
	out := &operatorv1.Worker{
		Spec: &operatorv1.WorkerSpec{
			Id: w.ID, Url: w.URL, Model: w.Model, Role: w.Role, BlockSize: uint32(w.BlockSize),
			KvEvents: w.KVEvents, KvEventsBind: w.KVEventsBind, KvEventsTopic: w.KVEventsTopic, KvEventsReplay: w.KVEventsReplay,
			Metrics: w.Metrics, Engine: w.Engine, Source: w.Source,
			MaxNumSeqs: uint32(w.MaxNumSeqs), MaxNumBatchedTokens: uint32(w.MaxNumBatchedTokens),
			LoraModules:     w.LoRAModules,
			KvBytesPerToken: uint64(w.KVBytesPerToken), HostBandwidth: w.HostBandwidth, DiskBandwidth: w.DiskBandwidth, SharedBandwidth: w.SharedBandwidth, PeerBandwidth: w.PeerBandwidth,
			P2PPort: uint32(w.P2PPort),
		},
		Status: &operatorv1.WorkerStatus{
			Healthy: st.Healthy, Draining: w.Draining,
			Running: uint32(st.Load.Running), Waiting: uint32(st.Load.Waiting), KvUsage: st.Load.KVUsage,
			Slot:   uint32(slot),
			Blocks: &operatorv1.BlockCounts{Gpu: uint64(b[0]), Cpu: uint64(b[1]), Disk: uint64(b[2]), Shared: uint64(b[3])},
		},
	}
	if out.Spec.Model == "" {
		out.Spec.Model = st.Model.ID
	}
	if out.Spec.BlockSize == 0 {
		out.Spec.BlockSize = uint32(st.BlockSize)
	}
	if !st.ObservedAt.IsZero() {
		out.Status.ObservedUnixNano = st.ObservedAt.UnixNano()
	}
	if in, ok := s.xds.Merged()[w.ID]; ok {
		out.Status.Inflight = uint32(min(in.Inflight, 1<<31))
	}
	if is := s.ingest.Stats(w.ID); is != nil {
		out.Status.Ingest = &operatorv1.IngestStats{
			Batches: is.Batches.Load(), Events: is.Events.Load(), Gaps: is.Gaps.Load(), Replays: is.Replays.Load(),
			Restarts: is.Restarts.Load(), Stale: is.Stale.Load(), LastEventUnixNano: is.LastEventUnixNano.Load(),
		}
	}
	return out
}

func (o operator) ListWorkers(context.Context) ([]*operatorv1.Worker, error) {
	ws := o.s.reg.Workers()
	out := make([]*operatorv1.Worker, 0, len(ws))
	for _, w := range ws {
		out = append(out, o.worker(w))
	}
	return out, nil
}

func (o operator) GetWorker(_ context.Context, id string) (*operatorv1.Worker, error) {
	w, ok := o.s.reg.Get(id)
	if !ok {
		return nil, fmt.Errorf("%w: %q", api.ErrNotFound, id)
	}
	return o.worker(w), nil
}

func (o operator) UpsertWorker(_ context.Context, spec *operatorv1.WorkerSpec) (*operatorv1.Worker, error) {
	w := registry.Worker{
		ID: spec.GetId(), URL: spec.GetUrl(), Model: spec.GetModel(), Role: spec.GetRole(), BlockSize: int(spec.GetBlockSize()),
		KVEvents: spec.GetKvEvents(), KVEventsBind: spec.GetKvEventsBind(), KVEventsTopic: spec.GetKvEventsTopic(), KVEventsReplay: spec.GetKvEventsReplay(),
		Metrics: spec.GetMetrics(), Engine: spec.GetEngine(),
		MaxNumSeqs: int(min(spec.GetMaxNumSeqs(), 1<<31-1)), MaxNumBatchedTokens: int(min(spec.GetMaxNumBatchedTokens(), 1<<31-1)),
		LoRAModules:     spec.GetLoraModules(),
		KVBytesPerToken: int(min(spec.GetKvBytesPerToken(), 1<<31-1)), HostBandwidth: spec.GetHostBandwidth(), DiskBandwidth: spec.GetDiskBandwidth(), SharedBandwidth: spec.GetSharedBandwidth(), PeerBandwidth: spec.GetPeerBandwidth(),
		P2PPort: int(min(spec.GetP2PPort(), 1<<20)),
	}.WithDefaults()
	if err := o.s.reg.Upsert(w); err != nil {
		return nil, apiErr(err)
	}
	got, _ := o.s.reg.Get(w.ID)
	return o.worker(got), nil
}

func (o operator) RemoveWorker(_ context.Context, id string) error {
	return apiErr(o.s.reg.Remove(id))
}

func (o operator) SetDraining(_ context.Context, id string, draining bool) (*operatorv1.Worker, error) {
	if err := o.s.reg.SetDraining(id, draining); err != nil {
		return nil, apiErr(err)
	}
	w, _ := o.s.reg.Get(id)
	return o.worker(w), nil
}

func policyMessage(p registry.Policy) *operatorv1.Policy {
	m := routingMessage(p)
	if p.Candidate != nil {
		m.Candidate = routingMessage(*p.Candidate)
		m.CandidateShare, m.Shadow = p.CandidateShare, p.Shadow
	}
	return m
}

// routingMessage is the routing part of a stored policy (no candidate).
func routingMessage(p registry.Policy) *operatorv1.Policy {
	r := routingResource(p)
	return &operatorv1.Policy{
		Version: r.Version, Policy: r.Policy, OverlapWeight: r.OverlapWeight, Temperature: r.Temperature,
		CacheThreshold: r.CacheThreshold, TierWeights: r.TierWeights, BusyPrefillTokens: r.BusyPrefillTokens,
		BusyDecodeBlocks: r.BusyDecodeBlocks, BusyKvFraction: r.BusyKvFraction, SessionTtlMs: r.SessionTtlMs,
		QueueWeight: r.QueueWeight, Disagg: r.Disagg, DisaggThreshold: r.DisaggThreshold,
		KernelLoadSignals: p.KernelLoadSignals,
		ComputeWeight:     r.ComputeWeight, BackgroundWeight: r.BackgroundWeight,
		Profile: profileMessage(p.Profile),
	}
}

func (o operator) GetPolicy(context.Context) (*operatorv1.Policy, error) {
	return policyMessage(o.s.reg.Policy()), nil
}

func (o operator) SetPolicy(_ context.Context, m *operatorv1.Policy) (*operatorv1.Policy, error) {
	p := storedPolicy(m)
	if c := m.GetCandidate(); c != nil {
		if c.GetCandidate() != nil || c.GetCandidateShare() != 0 || c.GetShadow() {
			return nil, apiErr(fmt.Errorf("%w: policy: the candidate has a candidate, share or shadow of its own", registry.ErrInvalid))
		}
		cp := storedPolicy(c)
		p.Candidate = &cp
		p.CandidateShare, p.Shadow = m.GetCandidateShare(), m.GetShadow()
	} else {
		p.CandidateShare, p.Shadow = m.GetCandidateShare(), m.GetShadow() // refused without a candidate
	}
	got, err := o.s.rollouts.setPolicy(p)
	if err != nil {
		return nil, apiErr(err)
	}
	return policyMessage(got), nil
}

func (o operator) StartRollout(_ context.Context, c *operatorv1.Policy, m *operatorv1.RolloutSpec) (*operatorv1.Rollout, error) {
	spec, err := rolloutSpec(m)
	if err != nil {
		return nil, err
	}
	if err := o.s.rollouts.start(storedPolicy(c), spec); err != nil {
		return nil, apiErr(err)
	}
	return o.GetRollout(context.Background())
}

func (o operator) GetRollout(context.Context) (*operatorv1.Rollout, error) {
	rec, cur, err := o.s.rollouts.latest()
	if err != nil {
		return nil, apiErr(err)
	}
	return rolloutMessage(rec, cur), nil
}

func (o operator) ControlRollout(_ context.Context, action string) (*operatorv1.Rollout, error) {
	if err := o.s.rollouts.control(action); err != nil {
		return nil, apiErr(err)
	}
	return o.GetRollout(context.Background())
}

func (o operator) PolicyHistory(_ context.Context, limit int) ([]*operatorv1.PolicyChange, error) {
	h, err := o.s.reg.PolicyHistory(limit)
	if err != nil {
		return nil, err
	}
	out := make([]*operatorv1.PolicyChange, len(h))
	for i, c := range h {
		out[i] = &operatorv1.PolicyChange{Policy: policyMessage(c.Policy), UnixMs: c.At.UnixMilli(), Cause: c.Cause}
	}
	return out, nil
}

// rolloutSpec is the spec an API request asks for: the defaults (rollout.DefaultSpec) for
// its unset fields, and a step timeout of five step durations when only the duration is
// set.
func rolloutSpec(m *operatorv1.RolloutSpec) (rollout.Spec, error) {
	s := rollout.DefaultSpec()
	ms := func(v int64) time.Duration { return time.Duration(v) * time.Millisecond }
	if m.GetShadowMs() < 0 || m.GetStepDurationMs() < 0 || m.GetStepTimeoutMs() < 0 {
		return s, fmt.Errorf("%w: rollout: negative duration", api.ErrInvalid)
	}
	s.Shadow = ms(m.GetShadowMs())
	if len(m.GetSteps()) > 0 {
		s.Steps = m.GetSteps()
	}
	if m.GetStepDurationMs() > 0 {
		s.StepDuration, s.StepTimeout = ms(m.GetStepDurationMs()), 5*ms(m.GetStepDurationMs())
	}
	if m.GetStepTimeoutMs() > 0 {
		s.StepTimeout = ms(m.GetStepTimeoutMs())
	}
	if m.GetMinRequests() > 0 {
		s.MinRequests = m.GetMinRequests()
	}
	for dst, v := range map[*float64]*float64{&s.MaxTTFTP90Ratio: m.MaxTtftP90Ratio, &s.MaxITLP90Ratio: m.MaxItlP90Ratio, &s.MaxErrorRateDelta: m.MaxErrorRateDelta,
		&s.MaxHitRateDrop: m.MaxHitRateDrop, &s.Alpha: m.Alpha, &s.MaxTTFTP50Ratio: m.MaxTtftP50Ratio, &s.FastAbortAlpha: m.FastAbortAlpha,
		&s.MaxShadowOverlapDrop: m.MaxShadowOverlapDrop, &s.MaxShadowLoadRatio: m.MaxShadowLoadRatio, &s.MaxBaselineTTFTP90Ratio: m.MaxBaselineTtftP90Ratio} {
		if v != nil {
			*dst = *v
		}
	}
	if m.GetMinGroups() > 0 {
		s.MinGroups = int(min(m.GetMinGroups(), 1<<20))
	}
	if m.GetFastAbortErrors() > 0 {
		s.FastAbortErrors = m.GetFastAbortErrors()
	}
	s.FailureLimit, s.InconclusiveLimit = int(min(m.GetFailureLimit(), 1<<20)), int(min(m.GetInconclusiveLimit(), 1<<20))
	if m.GetOnInconclusive() != "" {
		s.OnInconclusive = m.GetOnInconclusive()
	}
	if err := s.Validate(); err != nil {
		return s, fmt.Errorf("%w: %w", api.ErrInvalid, err)
	}
	return s, nil
}

// rolloutMessage is a rollout for the API, with cur the running step's figures so far.
func rolloutMessage(rec *rolloutRecord, cur rollout.Result) *operatorv1.Rollout {
	r := rec.R
	ms := func(t time.Time) int64 {
		if t.IsZero() {
			return 0
		}
		return t.UnixMilli()
	}
	share, shadow := r.Share()
	sp := r.Spec
	out := &operatorv1.Rollout{Id: rec.ID, State: r.State, Step: int32(r.Step), Share: share, Shadow: shadow,
		StableVersion: rec.StableVersion, CandidateVersion: rec.Candidate.Version, Candidate: routingMessage(rec.Candidate),
		Spec: &operatorv1.RolloutSpec{ShadowMs: sp.Shadow.Milliseconds(), Steps: sp.Steps, StepDurationMs: sp.StepDuration.Milliseconds(),
			MinRequests: sp.MinRequests, StepTimeoutMs: sp.StepTimeout.Milliseconds(),
			MaxTtftP90Ratio: proto.Float64(sp.MaxTTFTP90Ratio), MaxItlP90Ratio: proto.Float64(sp.MaxITLP90Ratio), MaxErrorRateDelta: proto.Float64(sp.MaxErrorRateDelta),
			MaxHitRateDrop: proto.Float64(sp.MaxHitRateDrop), Alpha: proto.Float64(sp.Alpha), MinGroups: uint32(sp.MinGroups),
			MaxTtftP50Ratio: proto.Float64(sp.MaxTTFTP50Ratio), FailureLimit: uint32(sp.FailureLimit), InconclusiveLimit: uint32(sp.InconclusiveLimit),
			OnInconclusive: sp.OnInconclusive, FastAbortAlpha: proto.Float64(sp.FastAbortAlpha), FastAbortErrors: sp.FastAbortErrors,
			MaxShadowOverlapDrop: proto.Float64(sp.MaxShadowOverlapDrop), MaxShadowLoadRatio: proto.Float64(sp.MaxShadowLoadRatio),
			MaxBaselineTtftP90Ratio: proto.Float64(sp.MaxBaselineTTFTP90Ratio)},
		StartedUnixMs: ms(rec.Started), StepStartedUnixMs: ms(r.StepStart), EndedUnixMs: ms(rec.Ended), Reason: rec.Reason}
	step := func(x rollout.Result) *operatorv1.RolloutStep {
		st := &operatorv1.RolloutStep{Step: int32(x.Step), Share: x.Share, Verdict: x.Verdict, Reason: x.Reason,
			StableRequests: x.StableRequests, CandidateRequests: x.CandidateRequests,
			StableTtftP50: x.StableTTFTP50, CandidateTtftP50: x.CandidateTTFTP50, StableTtftP90: x.StableTTFTP90, CandidateTtftP90: x.CandidateTTFTP90,
			StableErrorRate: x.StableErrorRate, CandidateErrorRate: x.CandidateErrorRate, StableHitRate: x.StableHitRate, CandidateHitRate: x.CandidateHitRate,
			ShadowPicks: x.ShadowPicks, ShadowDisagreement: x.ShadowDisagreement, ShadowStableOverlap: x.ShadowStableOverlap,
			ShadowCandidateOverlap: x.ShadowCandidateOverlap, ShadowStableLoad: x.ShadowStableLoad, ShadowCandidateLoad: x.ShadowCandidateLoad,
			StableItlP50: x.StableITLP50, CandidateItlP50: x.CandidateITLP50, StableItlP90: x.StableITLP90, CandidateItlP90: x.CandidateITLP90,
			StableServerErrorRate: x.StableServerErrorRate, CandidateServerErrorRate: x.CandidateServerErrorRate,
			StableRejectionRate: x.StableRejectionRate, CandidateRejectionRate: x.CandidateRejectionRate,
			StableRegretBlocks: x.StableRegret, CandidateRegretBlocks: x.CandidateRegret,
			StartUnixMs: ms(x.Start), EndUnixMs: ms(x.End),
			StableRouterErrorRate: x.StableRouterErrorRate, CandidateRouterErrorRate: x.CandidateRouterErrorRate,
			StableClientErrorRate: x.StableClientErrorRate, CandidateClientErrorRate: x.CandidateClientErrorRate,
			StableClientGoneRate: x.StableClientGoneRate, CandidateClientGoneRate: x.CandidateClientGoneRate,
			StableGroups: uint32(x.StableGroups), CandidateGroups: uint32(x.CandidateGroups)}
		for _, c := range x.Checks {
			st.Checks = append(st.Checks, &operatorv1.RolloutCheck{Metric: c.Metric, Stable: finite(c.Stable), Candidate: finite(c.Candidate),
				Effect: finite(c.Effect), Bound: c.Bound, T: finite(c.T), Critical: finite(c.Critical), Beyond: c.Beyond, Failed: c.Failed})
		}
		return st
	}
	for _, x := range r.Results {
		out.Steps = append(out.Steps, step(x))
	}
	if !r.Done() {
		out.Current = step(cur)
		out.Current.Suspect = r.Suspect
	}
	return out
}

// finite is v for JSON, an infinite or undefined figure (a test statistic with no spread)
// as the largest float.
func finite(v float64) float64 {
	switch {
	case math.IsNaN(v):
		return 0
	case math.IsInf(v, 1):
		return math.MaxFloat64
	case math.IsInf(v, -1):
		return -math.MaxFloat64
	}
	return v
}

// storedPolicy is the routing part of an API policy (no candidate; versions are the
// registry's to assign).
func storedPolicy(m *operatorv1.Policy) registry.Policy {
	p := registry.Policy{
		Name: m.GetPolicy(), OverlapWeight: m.GetOverlapWeight(), QueueWeight: m.GetQueueWeight(),
		Disagg: m.GetDisagg(), DisaggThreshold: m.DisaggThreshold, KernelLoadSignals: m.GetKernelLoadSignals(),
		Temperature:    m.GetTemperature(),
		CacheThreshold: m.GetCacheThreshold(), TierWeights: m.GetTierWeights(),
		BusyPrefillTokens: m.GetBusyPrefillTokens(), BusyDecodeBlocks: m.GetBusyDecodeBlocks(),
		BusyKVFraction: m.GetBusyKvFraction(), SessionTTL: time.Duration(m.GetSessionTtlMs()) * time.Millisecond,
		ComputeWeight: m.ComputeWeight, BackgroundWeight: m.BackgroundWeight,
	}
	if pr := m.GetProfile(); pr != nil {
		p.Profile = xds.ProfileOf(sameWire(pr, new(xdsv1.Profile)))
	}
	return p
}

// profileMessage is a stored profile for the API (nil for none).
func profileMessage(p *policy.Profile) *operatorv1.Profile {
	if p == nil {
		return nil
	}
	return sameWire(xds.ProfileResource(p), new(operatorv1.Profile))
}

// sameWire copies from into to, two messages of one wire form: the operator API's Profile
// and the xDS resource's are field for field the same, so one conversion (package xds)
// serves both. It returns the zero T (nil) for a message that does not marshal (invalid
// UTF-8, which neither API's decoder lets in): a custom policy without its profile, which
// validation refuses.
func sameWire[T proto.Message](from proto.Message, to T) T {
	var zero T
	b, err := proto.Marshal(from)
	if err != nil || proto.Unmarshal(b, to) != nil {
		return zero
	}
	return to
}

func (o operator) GetIndex(context.Context) (*operatorv1.Index, error) {
	s := o.s
	out := &operatorv1.Index{
		TotalBlocks:   uint64(s.index.Len()),
		JournalEpoch:  s.journal.Epoch(),
		JournalOffset: s.journal.Next(),
		IngestRate:    s.ingestRate(),
	}
	for slot, id := range s.index.Workers() {
		if id == "" {
			continue
		}
		b := s.index.Blocks(id)
		out.Workers = append(out.Workers, &operatorv1.WorkerBlocks{Id: id, Slot: uint32(slot),
			Blocks: &operatorv1.BlockCounts{Gpu: uint64(b[0]), Cpu: uint64(b[1]), Disk: uint64(b[2]), Shared: uint64(b[3])}})
	}
	return out, nil
}

func (o operator) ListTenants(context.Context) ([]*operatorv1.Tenant, error) {
	totals := o.s.xds.TenantTotals()
	out := make([]*operatorv1.Tenant, 0, len(totals))
	for name, t := range totals {
		out = append(out, &operatorv1.Tenant{Name: name, Proxies: uint32(t.Proxies), RequestsPerSecond: t.Requests,
			PromptTokensPerSecond: t.PromptTokens, OutputTokensPerSecond: t.OutputTokens, Admitted: t.Admitted, Refused: t.Refused})
	}
	slices.SortFunc(out, func(a, b *operatorv1.Tenant) int { return strings.Compare(a.GetName(), b.GetName()) })
	return out, nil
}

func (o operator) ListAPIKeys(context.Context) ([]*operatorv1.ApiKey, error) {
	keys, err := o.s.store.APIKeys()
	if err != nil {
		return nil, err
	}
	out := make([]*operatorv1.ApiKey, 0, len(keys))
	for _, k := range keys {
		out = append(out, apiKeyMessage(k))
	}
	return out, nil
}

func apiKeyMessage(k registry.APIKey) *operatorv1.ApiKey {
	return &operatorv1.ApiKey{Id: k.ID, Sha256: k.SHA256, Tenant: k.Tenant, Weight: k.Weight, Rps: k.RPS,
		PromptTps: k.PromptTPS, OutputTpm: k.OutputTPM, Cache: k.Cache}
}

// PutAPIKey stores the key by its SHA-256 (the key itself is forgotten), refusing one that
// another key of the same tenant contradicts, and gives the proxies the new keys.
func (o operator) PutAPIKey(_ context.Context, m *operatorv1.ApiKey) (*operatorv1.ApiKey, error) {
	sum := strings.ToLower(m.GetSha256())
	if key := m.GetKey(); key != "" {
		h := sha256.Sum256([]byte(key))
		if given := hex.EncodeToString(h[:]); sum != "" && sum != given {
			return nil, fmt.Errorf("%w: API key %q: the key's SHA-256 is not the sha256 given", api.ErrInvalid, m.GetId())
		} else {
			sum = given
		}
	}
	k := registry.APIKey{ID: m.GetId(), SHA256: sum, Tenant: m.GetTenant(), Weight: m.GetWeight(), RPS: m.GetRps(),
		PromptTPS: m.GetPromptTps(), OutputTPM: m.GetOutputTpm(), Cache: m.GetCache()}
	if err := k.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", api.ErrInvalid, err)
	}
	o.s.keysMu.Lock()
	defer o.s.keysMu.Unlock()
	keys, err := o.s.store.APIKeys()
	if err != nil {
		return nil, err
	}
	keys = slices.DeleteFunc(keys, func(other registry.APIKey) bool { return other.ID == k.ID })
	if err := registry.CheckAPIKeys(append(keys, k)); err != nil {
		return nil, fmt.Errorf("%w: %w", api.ErrConflict, err)
	}
	if err := o.s.store.PutAPIKey(k); err != nil {
		return nil, err
	}
	o.s.publishKeys()
	return apiKeyMessage(k), nil
}

func (o operator) DeleteAPIKey(_ context.Context, id string) error {
	o.s.keysMu.Lock()
	defer o.s.keysMu.Unlock()
	keys, err := o.s.store.APIKeys()
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(keys, func(k registry.APIKey) bool { return k.ID == id }) {
		return fmt.Errorf("%w: no API key %q", api.ErrNotFound, id)
	}
	if err := o.s.store.DeleteAPIKey(id); err != nil {
		return err
	}
	o.s.publishKeys()
	return nil
}

func (o operator) ListProxies(context.Context) ([]*operatorv1.Proxy, error) {
	st := o.s.xds.Stats()
	out := make([]*operatorv1.Proxy, 0, len(st.Proxies))
	for id, n := range st.Proxies {
		p := &operatorv1.Proxy{NodeId: id, Streams: uint32(n)}
		if nack, ok := st.LastNACK[id]; ok {
			p.LastNack = &operatorv1.Nack{TypeUrl: nack.TypeURL, Reason: nack.Reason, UnixNano: nack.At.UnixNano()}
		}
		out = append(out, p)
	}
	return out, nil
}
