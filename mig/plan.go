package mig

import (
	"fmt"
	"math/bits"
	"slices"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/gpu-agent/gpu-agent/gpu"
)

// Phases of a GPU's MIG state.
const (
	// PhaseApplied: the GPU has the wanted layout.
	PhaseApplied = "applied"
	// PhasePlanned: Plan returned steps that Apply must run.
	PhasePlanned = "planned"
	// PhasePending: an instance that must go is held by a pod (or processes
	// block a mode change); the GPU converges once it is released.
	PhasePending = "pending"
	// PhaseResetRequired: a MIG mode change waits for a GPU reset, which the
	// agent never does itself.
	PhaseResetRequired = "reset-required"
	// PhaseFailed: the layout is impossible or a step failed; Reason says which.
	PhaseFailed = "failed"
)

// State is a GPU's MIG state with the reason for it.
type State struct {
	Phase  string `json:"phase"`
	Reason string `json:"reason,omitempty"`
}

// Op is what a step does.
type Op string

// Step operations.
const (
	OpSetMode Op = "set-mig-mode"
	// OpDestroy destroys a GPU instance and its compute instances.
	OpDestroy Op = "destroy"
	// OpCreate creates a GPU instance at a placement with one compute
	// instance spanning it.
	OpCreate Op = "create"
)

// Step is one action of a plan. Steps name instances by profile and
// placement, not by GI id: a placement identifies an instance for as long as
// it lives, while ids are reused, so a step replayed after a crash never
// touches the wrong instance.
type Step struct {
	Op Op `json:"op"`
	// Enable is the mode OpSetMode sets.
	Enable bool `json:"enable,omitempty"`
	// Profile and ProfileIndex (GPU_INSTANCE_PROFILE_*) of the GPU instance.
	Profile      string        `json:"profile,omitempty"`
	ProfileIndex int           `json:"profileIndex,omitempty"`
	Placement    gpu.Placement `json:"placement"`
	// GI is the id the instance had when planned (OpDestroy), for messages.
	GI int `json:"gi,omitempty"`
	// UUIDs are the MIG devices OpDestroy removes.
	UUIDs []string `json:"uuids,omitempty"`
	// Bare: OpDestroy removes the GPU instance only while it has no
	// compute instance (one left half-made); one that has one by then is
	// someone's MIG device, and stays.
	Bare   bool   `json:"bare,omitempty"`
	Reason string `json:"reason"`
}

// same reports whether s and o make the same change (their reasons and
// the instance ids named for messages aside).
func (s Step) same(o Step) bool {
	return s.Op == o.Op && s.Enable == o.Enable && s.Profile == o.Profile && s.ProfileIndex == o.ProfileIndex &&
		s.Placement == o.Placement && s.Bare == o.Bare && slices.Equal(s.UUIDs, o.UUIDs)
}

// check refuses a step no planner makes (a journal read back is outside
// input): an unknown op, or a GPU instance outside the profile indices and
// memory slices NVML has.
func (s Step) check() error {
	switch s.Op {
	case OpSetMode:
		return nil
	case OpDestroy, OpCreate:
	default:
		return fmt.Errorf("unknown op %q", s.Op)
	}
	if s.ProfileIndex < 0 || s.ProfileIndex >= nvml.GPU_INSTANCE_PROFILE_COUNT {
		return fmt.Errorf("%s: profile index %d out of range", s.Op, s.ProfileIndex)
	}
	if s.Placement.Start < 0 || s.Placement.Size <= 0 || s.Placement.Start+s.Placement.Size > maxSlices {
		return fmt.Errorf("%s: placement %d+%d out of range", s.Op, s.Placement.Start, s.Placement.Size)
	}
	return nil
}

// maxSlices bounds a placement's memory slices: 8 on every MIG GPU so far,
// with room to spare.
const maxSlices = 64

func (s Step) String() string {
	switch s.Op {
	case OpSetMode:
		return fmt.Sprintf("set MIG mode enabled=%t", s.Enable)
	case OpDestroy:
		return fmt.Sprintf("destroy %s gi %d at %d+%d", s.Profile, s.GI, s.Placement.Start, s.Placement.Size)
	}
	return fmt.Sprintf("create %s at %d+%d", s.Profile, s.Placement.Start, s.Placement.Size)
}

// Plan is the ordered steps that take one GPU to its wanted layout: mode
// change first, then destroys, then creates.
type Plan struct {
	GPU   int    `json:"gpu"`
	UUID  string `json:"uuid"`
	Want  Want   `json:"want"`
	Steps []Step `json:"steps"`
	// Held is the MIG UUID → holder map the plan was made with; Apply refuses
	// to destroy any of them when it resumes an older plan.
	Held map[string]string `json:"held,omitempty"`
	// DestroyBlocked, when set, is why no MIG device may be destroyed now
	// (the kubelet could not say who holds what). Apply then stops, pending,
	// at the first step that would destroy one, also when it resumes an
	// older plan from its journal.
	DestroyBlocked string `json:"-"`
	// Draining, on a plan pending on holders, lists the MIG devices the
	// layout destroys once they are released, held or not: the node stops
	// offering them, so new work does not keep the layout from ever
	// applying.
	Draining []string `json:"-"`
	// Exact: the plan is these steps, not a way to reach Want (the agent's
	// own changes for claims: one device at one placement, which Want's
	// counts do not say). A journal is resumed for an exact plan only if
	// it is one with the same steps, and an exact plan's journal only for
	// such a plan; otherwise it is abandoned.
	Exact bool `json:"exact,omitempty"`
}

// resumes reports whether a journal of plan j is what p resumes: the same
// layout (Want) for layout plans, the same steps for exact ones.
func (j Plan) resumes(p Plan) bool {
	if j.Exact || p.Exact {
		return j.Exact && p.Exact && j.Want.Equal(p.Want) && slices.EqualFunc(j.Steps, p.Steps, Step.same)
	}
	return j.Want.Equal(p.Want)
}

// Destroys counts the instances the plan destroys.
func (p Plan) Destroys() int {
	n := 0
	for _, s := range p.Steps {
		if s.Op == OpDestroy {
			n++
		}
	}
	return n
}

// existing is one GPU instance of the snapshot with its compute instances.
type existing struct {
	gi      int
	profile Profile
	pl      gpu.Placement
	uuids   []string
	// clean: exactly one compute instance spanning the GPU instance, the
	// only shape the planner creates and so the only one it can keep.
	clean bool
	// bare: no compute instance at all (gpu.GPU.GIsWithoutCI).
	bare    bool
	holders []string // "uuid held by ns/pod"
}

// reasonBare is why a GPU instance without a compute instance is destroyed.
const reasonBare = "GPU instance without a compute instance (left by an interrupted change)"

// MakePlan computes the Plan that takes g to want (named MakePlan because
// Plan is the result type). It is pure: g is the snapshot, held maps MIG device UUIDs to the pod that
// holds them (kubelet pod-resources). It returns PhaseApplied with no steps
// when g already has the layout, PhasePlanned with steps, PhasePending or
// PhaseResetRequired with no steps when the GPU must wait, and PhaseFailed
// with an error naming the GPU when the layout is impossible on it or g's
// MIG state was not read completely (g.MIGUnknown).
//
// A GPU instance without a compute instance (g.GIsWithoutCI) is always
// destroyed, never finished, even where the layout wants its profile at its
// placement: no MIG device stands for it, so no pod can hold it and
// destroying costs no more than creating it again; and the planner keeps
// reasoning about whole instances only, the one shape it creates, instead
// of guessing whether the instance was being built up or torn down (a crash
// between a destroy's compute and GPU instance leaves the same thing as one
// inside a create).
func MakePlan(g gpu.GPU, profiles Profiles, want Want, held map[string]string) (Plan, State, error) {
	p := Plan{GPU: g.Index, UUID: g.UUID, Want: want, Held: held}
	fail := func(format string, args ...any) (Plan, State, error) {
		err := fmt.Errorf("gpu %d (%s): "+format, append([]any{g.Index, g.UUID}, args...)...)
		return p, State{Phase: PhaseFailed, Reason: err.Error()}, err
	}
	if g.MIGUnknown() {
		// An instance missing from a partial read may exist and be held by
		// a pod; a plan from it could destroy or collide with it.
		return fail("MIG state not read completely (unread: %s); not planning from a partial inventory", joinFacts(g.Unread))
	}
	if want.MIGEnabled && !g.MIGCapable {
		return fail("%w: %s does not support MIG", ErrLayout, g.Name)
	}
	gis, err := group(g, profiles, held)
	if err != nil {
		return fail("%v", err)
	}

	if !want.MIGEnabled {
		switch {
		case !g.MIG.Current && g.MIG.Pending:
			p.Steps = append(p.Steps, Step{Op: OpSetMode, Reason: "cancel the pending MIG enable"})
		case !g.MIG.Current:
			return p, State{Phase: PhaseApplied}, nil
		case !g.MIG.Pending:
			return p, State{Phase: PhaseResetRequired, Reason: "MIG disable waits for a GPU reset"}, nil
		default:
			if h := holdersOf(gis); len(h) > 0 {
				return p, State{Phase: PhasePending, Reason: "MIG disable waits for " + strings.Join(h, ", ")}, nil
			}
			for _, e := range gis {
				why := "MIG is to be disabled"
				if e.bare {
					why = reasonBare
				}
				p.Steps = append(p.Steps, destroyStep(e, why))
			}
			p.Steps = append(p.Steps, Step{Op: OpSetMode, Reason: "layout wants MIG disabled"})
		}
		return p, State{Phase: PhasePlanned}, nil
	}

	if err := validate(profiles, want); err != nil {
		return fail("%w: %w", ErrLayout, err)
	}
	if !g.MIG.Current {
		if g.MIG.Pending {
			return p, State{Phase: PhaseResetRequired, Reason: "MIG enable waits for a GPU reset"}, nil
		}
		// With MIG off there are no instances: the mode change comes first
		// and the whole layout is created on the empty GPU.
		p.Steps = append(p.Steps, Step{Op: OpSetMode, Enable: true, Reason: "layout wants MIG enabled"})
		gis = nil
	} else if !g.MIG.Pending {
		p.Steps = append(p.Steps, Step{Op: OpSetMode, Enable: true, Reason: "cancel the pending MIG disable"})
	}

	best, ok := chooseKeep(profiles, want, gis, true)
	if !ok {
		free, ok := chooseKeep(profiles, want, gis, false)
		if !ok {
			return fail("no placement fits %s", want)
		}
		var blocking []string
		for i, e := range gis {
			if free.keep[i] {
				continue
			}
			blocking = append(blocking, e.holders...)
			p.Draining = append(p.Draining, e.uuids...)
		}
		return p, State{Phase: PhasePending, Reason: "layout " + want.String() + " waits for " + strings.Join(blocking, ", ")}, nil
	}
	for i, e := range gis {
		if !best.keep[i] {
			why := "no longer wanted"
			switch {
			case e.bare:
				why = reasonBare
			case !e.clean:
				why = "not a single full compute instance"
			case want.Counts[e.profile.Name] > 0:
				why = "makes room for the wanted layout"
			}
			p.Steps = append(p.Steps, destroyStep(e, why))
		}
	}
	for _, c := range best.create {
		p.Steps = append(p.Steps, Step{
			Op: OpCreate, Profile: c.profile.Name, ProfileIndex: c.profile.Index, Placement: c.pl,
			Reason: fmt.Sprintf("layout wants %d× %s", want.Counts[c.profile.Name], c.profile.Name),
		})
	}
	if len(p.Steps) == 0 {
		return p, State{Phase: PhaseApplied}, nil
	}
	return p, State{Phase: PhasePlanned}, nil
}

func destroyStep(e existing, why string) Step {
	return Step{
		Op: OpDestroy, Profile: e.profile.Name, ProfileIndex: e.profile.Index, Placement: e.pl,
		GI: e.gi, UUIDs: e.uuids, Reason: why,
	}
}

func holdersOf(gis []existing) []string {
	var out []string
	for _, e := range gis {
		out = append(out, e.holders...)
	}
	return out
}

// group folds the snapshot's MIG devices into GPU instances, by GI id, and
// adds the GPU instances without a compute instance.
func group(g gpu.GPU, profiles Profiles, held map[string]string) ([]existing, error) {
	var out []existing
	for _, in := range g.Instances {
		i := slices.IndexFunc(out, func(e existing) bool { return e.gi == in.GI })
		if i < 0 {
			prof, ok := profiles.byIndex(in.GIProfileID)
			if !ok {
				return nil, fmt.Errorf("gi %d: profile index %d not among the GPU's profiles", in.GI, in.GIProfileID)
			}
			out = append(out, existing{gi: in.GI, profile: prof, pl: in.Placement, clean: true})
			i = len(out) - 1
		}
		e := &out[i]
		e.uuids = append(e.uuids, in.UUID)
		e.clean = len(e.uuids) == 1 && in.Profile == e.profile.Name
		if h, ok := held[in.UUID]; ok {
			e.holders = append(e.holders, fmt.Sprintf("%s (%s) held by %s", in.UUID, in.Profile, h))
		}
	}
	for _, b := range g.GIsWithoutCI {
		prof, ok := profiles.byIndex(b.GIProfileID)
		if !ok {
			return nil, fmt.Errorf("gi %d: profile index %d not among the GPU's profiles", b.GI, b.GIProfileID)
		}
		out = append(out, existing{gi: b.GI, profile: prof, pl: b.Placement, bare: true})
	}
	return out, nil
}

func joinFacts(fs []gpu.Fact) string {
	out := make([]string, len(fs))
	for i, f := range fs {
		out[i] = string(f)
	}
	return strings.Join(out, ", ")
}

// validate rejects layouts no empty GPU of this model can hold, with the
// most specific reason.
func validate(profiles Profiles, want Want) error {
	slicesNeeded := 0
	for _, name := range sortedNames(want.Counts) {
		n := want.Counts[name]
		p, ok := profiles[name]
		if !ok {
			return fmt.Errorf("profile %s not offered (the GPU offers %s)", name, strings.Join(profiles.names(), ", "))
		}
		if n > int(p.Info.InstanceCount) {
			return fmt.Errorf("%d× %s exceeds the profile's limit of %d per GPU", n, name, p.Info.InstanceCount)
		}
		slicesNeeded += n * placementSize(p)
	}
	if total := profiles.memorySlices(); slicesNeeded > total {
		return fmt.Errorf("layout %s needs %d memory slices, the GPU has %d", want, slicesNeeded, total)
	}
	if err := ofaFits(profiles, want); err != nil {
		return err
	}
	if _, ok := place(profiles, 0, need(profiles, want.Counts, nil)); !ok {
		return fmt.Errorf("no placement of %s fits the GPU's memory slices", want)
	}
	return nil
}

// ofaFits checks the optical flow accelerators: a GPU instance gets its own,
// so the layout's instances together may have no more than the GPU, which
// is what its largest profile has (an A30 has one: one of 1g.6gb+me and
// 2g.12gb+me, not both; an H100 has one for a single +me instance).
func ofaFits(profiles Profiles, want Want) error {
	var total uint32
	for _, p := range profiles {
		total = max(total, p.Info.OfaCount)
	}
	need := uint32(0)
	var users []string
	for _, name := range sortedNames(want.Counts) {
		if c := profiles[name].Info.OfaCount; c > 0 {
			need += c * uint32(want.Counts[name])
			users = append(users, fmt.Sprintf("%d× %s", want.Counts[name], name))
		}
	}
	if need > total {
		return fmt.Errorf("layout %s needs %d optical flow accelerators (%s), the GPU has %d", want, need, strings.Join(users, ", "), total)
	}
	return nil
}

func sortedNames(m map[string]int) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

type newInstance struct {
	profile Profile
	pl      gpu.Placement
}

type choice struct {
	keep   []bool
	create []newInstance
	score  []int
}

// chooseKeep finds the largest set of existing instances the layout can keep
// and the placements of the instances still missing. Every subset of the
// (at most 8) instances is tried, so "can keep" is exact: an instance goes
// only when no placement of the rest fits with it. Among subsets of equal
// size the one leaving the most usable free space wins. With forceHeld, a
// subset must keep every held instance.
func chooseKeep(profiles Profiles, want Want, gis []existing, forceHeld bool) (choice, bool) {
	var best choice
	found := false
	n := len(gis)
	// Larger subsets first, so the first feasible size is the answer.
	subsets := make([]uint32, 0, 1<<n)
	for s := range uint32(1) << n {
		subsets = append(subsets, s)
	}
	slices.SortStableFunc(subsets, func(a, b uint32) int { return bits.OnesCount32(b) - bits.OnesCount32(a) })
	bestSize := -1
	for _, s := range subsets {
		size := bits.OnesCount32(s)
		if found && size < bestSize {
			break
		}
		keep := make([]bool, n)
		counts := map[string]int{}
		var occ uint32
		ok := true
		for i, e := range gis {
			in := s&(1<<i) != 0
			keep[i] = in
			if !in {
				if forceHeld && len(e.holders) > 0 {
					ok = false
				}
				continue
			}
			counts[e.profile.Name]++
			if !e.clean || counts[e.profile.Name] > want.Counts[e.profile.Name] || occ&mask(e.pl) != 0 {
				ok = false
			}
			occ |= mask(e.pl)
		}
		if !ok {
			continue
		}
		res, ok := place(profiles, occ, need(profiles, want.Counts, counts))
		if !ok {
			continue
		}
		if !found || better(res.score, best.score) {
			best = choice{keep: keep, create: res.create, score: res.score}
			found, bestSize = true, size
		}
	}
	return best, found
}

// need lists the instances still to create, largest first (the order that
// prunes the search soonest).
func need(profiles Profiles, want, have map[string]int) []Profile {
	var out []Profile
	for _, p := range profiles.ordered() {
		for range want[p.Name] - have[p.Name] {
			out = append(out, p)
		}
	}
	return out
}

type placed struct {
	create []newInstance
	score  []int
}

// place is the exact placement search: every assignment of possible
// placements to the instances in todo that overlaps nothing in occ, with
// instances of one profile taken in ascending start order (they are
// interchangeable). A GPU has at most 8 memory slices and 7 instances, so
// the search visits at most a few thousand nodes. The winner leaves the free
// slices most usable (see usability); ties go to the lowest starts.
func place(profiles Profiles, occ uint32, todo []Profile) (placed, bool) {
	var best placed
	found := false
	cur := make([]newInstance, len(todo))
	order := profiles.ordered()
	var rec func(k int, occ uint32, minStart int)
	rec = func(k int, occ uint32, minStart int) {
		if k == len(todo) {
			sc := usability(order, occ)
			if !found || better(sc, best.score) {
				best = placed{create: slices.Clone(cur), score: sc}
				found = true
			}
			return
		}
		p := todo[k]
		for _, pl := range p.Placements {
			if pl.Start < minStart || occ&mask(pl) != 0 {
				continue
			}
			cur[k] = newInstance{profile: p, pl: pl}
			next := 0
			if k+1 < len(todo) && todo[k+1].Name == p.Name {
				next = pl.Start + 1
			}
			rec(k+1, occ|mask(pl), next)
		}
	}
	rec(0, occ, 0)
	return best, found
}

// usability scores free space: for each profile, largest first, how many of
// its placements are entirely free. Compared lexicographically, it keeps
// large aligned blocks free before small ones, because a small instance fits
// in many places and a large one only in few.
func usability(order []Profile, occ uint32) []int {
	out := make([]int, len(order))
	for i, p := range order {
		for _, pl := range p.Placements {
			if occ&mask(pl) == 0 {
				out[i]++
			}
		}
	}
	return out
}

func better(a, b []int) bool { return slices.Compare(a, b) > 0 }

// Placed is one GPU instance of a layout, at its placement.
type Placed struct {
	Profile   string
	Placement gpu.Placement
}

// PlaceLayout places counts on an empty GPU whose profiles are ps, as the
// plan of a layout would (the placement that leaves the free slices most
// usable, ties to the lowest starts), in placement order; the error says
// why no empty GPU of the model can hold them.
func PlaceLayout(ps Profiles, counts map[string]int) ([]Placed, error) {
	want := Want{MIGEnabled: true, Counts: counts}
	if err := validate(ps, want); err != nil {
		return nil, err
	}
	res, _ := place(ps, 0, need(ps, counts, nil))
	out := make([]Placed, 0, len(res.create))
	for _, n := range res.create {
		out = append(out, Placed{Profile: n.profile.Name, Placement: n.pl})
	}
	slices.SortFunc(out, func(a, b Placed) int { return a.Placement.Start - b.Placement.Start })
	return out, nil
}
