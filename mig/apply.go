package mig

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/stateformat"
)

// Library is the part of nvml.Interface the applier uses.
type Library interface {
	DeviceGetHandleByIndex(index int) (nvml.Device, nvml.Return)
}

// Guard is asked before each step that destroys MIG devices or changes a
// GPU's MIG mode (the agent's ledger): Doom marks the devices as about to
// go, so nothing hands them out meanwhile, or refuses because someone holds
// one. A refusal stops the plan there, pending, with the reason.
type Guard interface {
	Doom(uuids []string, why string) error
}

// Applier runs plans against NVML. Progress is journaled per GPU under
// stateDir/mig, so that after a crash or restart Apply resumes the plan that
// was in flight instead of planning afresh from a half-changed GPU.
type Applier struct {
	lib Library
	dir string
	log *slog.Logger
	// crash, when set (tests only), is asked at each point a process could
	// die; returning true makes Apply stop there as if killed. The points
	// are "before" and "after" every step, and "mid" inside a destroy (its
	// compute instances gone, its GPU instance not yet) and a create (its
	// GPU instance made, its compute instance not yet).
	crash func(point string, step int) bool
	// write replaces a journal atomically (atomicfile.Write, or a test's
	// stand-in: SetWrite).
	write func(path string, data []byte, opts ...atomicfile.Options) error
}

// errCrashed is what Apply returns when the test hook stops it.
var errCrashed = errors.New("simulated crash")

// NewApplier journals under stateDir/mig (created on first use).
func NewApplier(lib Library, stateDir string, log *slog.Logger) *Applier {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Applier{lib: lib, dir: filepath.Join(stateDir, "mig"), log: log, write: atomicfile.Write}
}

// SetWrite replaces how journals are written (default atomicfile.Write):
// tests fail it as a full or read-only state dir would, which stops a plan
// before the step whose progress could not be recorded.
func (a *Applier) SetWrite(write func(path string, data []byte, opts ...atomicfile.Options) error) {
	a.write = write
}

// journalFormat is the journal's format: "version" the major (absent: 1),
// "minor" the minor (absent: 0). A journal names its version only when it
// is not 1.0, the format of the agents before journals carried one, so
// that such an agent, rolled back to mid-plan, still resumes what this one
// wrote while nothing was added.
var journalFormat = stateformat.Format{Reads: []stateformat.Version{{Major: 1, Minor: 0}}, Unversioned: stateformat.Version{Major: 1}}

type journal struct {
	// Version and Minor are the format's version (journalFormat; both 0:
	// 1.0).
	Version int  `json:"version,omitempty"`
	Minor   int  `json:"minor,omitempty"`
	Plan    Plan `json:"plan"`
	// Next is the first step not known to be done. Steps are idempotent, so
	// the one at Next is run again on resume whether or not it had finished.
	Next int `json:"next"`
}

// Apply runs p on GPU p.GPU. When a journal for that GPU holds an unfinished
// plan for the same wanted layout (an exact plan: the same steps,
// Plan.Exact), that plan is resumed from its last step instead; an
// unfinished plan for another layout is abandoned (an instance it
// was half-way through creating is removed first). On a failed step the GPU
// is left with whole instances only and the state says which step failed.
// Every destroy and mode change, a resumed plan's included, asks g first
// (nil: nothing to ask, for a node nothing runs on: the offline tools').
func (a *Applier) Apply(ctx context.Context, p Plan, g Guard) (State, error) {
	dev, err := a.device(p)
	if err != nil {
		return State{Phase: PhaseFailed, Reason: err.Error()}, err
	}
	j, err := a.load(p.UUID)
	if err != nil {
		return State{Phase: PhaseFailed, Reason: err.Error()}, err
	}
	switch {
	case j != nil && j.Plan.resumes(p):
		a.log.Info("resuming MIG plan", "gpu", p.GPU, "uuid", p.UUID, "step", j.Next, "steps", len(j.Plan.Steps))
		j.Plan.Held = p.Held // holders now, not when the old plan was made
		j.Plan.DestroyBlocked = p.DestroyBlocked
	case j != nil:
		a.log.Info("abandoning MIG plan for an older layout", "gpu", p.GPU, "uuid", p.UUID, "want", j.Plan.Want.String())
		if err := a.abandon(dev, j); err != nil {
			return a.failed(p, err)
		}
		j = nil
	}
	if j == nil {
		if len(p.Steps) == 0 {
			return State{Phase: PhaseApplied}, nil
		}
		j = &journal{Plan: p}
		if err := a.save(j); err != nil {
			return a.failed(p, err)
		}
	}
	for j.Next < len(j.Plan.Steps) {
		if err := ctx.Err(); err != nil {
			return State{Phase: PhaseFailed, Reason: "interrupted: " + err.Error()}, err
		}
		s := j.Plan.Steps[j.Next]
		if a.crashAt("before", j.Next) {
			return State{}, errCrashed
		}
		st, err := guarded(g, j.Plan, s)
		if err == nil && st.Phase == "" {
			st, err = a.step(dev, j.Plan, j.Next, s)
		}
		if errors.Is(err, errCrashed) {
			return State{}, err
		}
		if err != nil || st.Phase != "" {
			// The GPU holds whole instances only (step undoes its half), so
			// the journal goes: the next plan starts from what NVML shows.
			_ = a.remove(p.UUID)
			if err != nil {
				return a.failed(j.Plan, fmt.Errorf("step %d (%s): %w", j.Next, s, err))
			}
			return st, nil
		}
		if a.crashAt("after", j.Next) {
			return State{}, errCrashed
		}
		a.log.Info("MIG step done", "gpu", p.GPU, "uuid", p.UUID, "step", s.String(), "reason", s.Reason)
		j.Next++
		if err := a.save(j); err != nil {
			return a.failed(j.Plan, err)
		}
	}
	if err := a.remove(p.UUID); err != nil {
		return a.failed(p, err)
	}
	return State{Phase: PhaseApplied}, nil
}

// NoPermissionHint is added to a MIG change NVML refuses for want of
// privileges: the Helm chart's default, mig.access=monitor, lets the agent
// list MIG instances but not change them.
const NoPermissionHint = "the agent's container may list MIG instances but not change them: " +
	"install the Helm chart with mig.access=manage (plain manifests: a privileged container, see deploy/README.md)"

func (a *Applier) failed(p Plan, err error) (State, error) {
	if errors.Is(err, nvml.ERROR_NO_PERMISSION) {
		err = fmt.Errorf("%w; %s", err, NoPermissionHint)
	}
	err = fmt.Errorf("gpu %d (%s): %w", p.GPU, p.UUID, err)
	return State{Phase: PhaseFailed, Reason: err.Error()}, err
}

func (a *Applier) crashAt(point string, step int) bool { return a.crash != nil && a.crash(point, step) }

// device finds the GPU and checks it is the one planned for: indices can
// move when a GPU falls off the bus.
func (a *Applier) device(p Plan) (nvml.Device, error) {
	dev, ret := a.lib.DeviceGetHandleByIndex(p.GPU)
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("gpu %d (%s): DeviceGetHandleByIndex: %w", p.GPU, p.UUID, ret)
	}
	uuid, ret := dev.GetUUID()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("gpu %d (%s): GetUUID: %w", p.GPU, p.UUID, ret)
	}
	if uuid != p.UUID {
		return nil, fmt.Errorf("gpu %d is now %s, plan was for %s", p.GPU, uuid, p.UUID)
	}
	return dev, nil
}

// guarded asks g about a step that destroys MIG devices (their UUIDs) or
// changes the GPU's mode (the GPU's UUID); a refusal is pending.
func guarded(g Guard, p Plan, s Step) (State, error) {
	var uuids []string
	switch {
	case g == nil:
		return State{}, nil
	case s.Op == OpDestroy:
		uuids = s.UUIDs
	case s.Op == OpSetMode:
		uuids = []string{p.UUID}
	}
	if len(uuids) == 0 {
		return State{}, nil
	}
	if err := g.Doom(uuids, fmt.Sprintf("GPU %d: %s (%s)", p.GPU, s, s.Reason)); err != nil {
		return State{Phase: PhasePending, Reason: fmt.Sprintf("%s waits: %v", s, err)}, nil
	}
	return State{}, nil
}

// step runs one step. A non-empty State.Phase stops the plan without error
// (pending, reset-required).
func (a *Applier) step(dev nvml.Device, p Plan, k int, s Step) (State, error) {
	switch s.Op {
	case OpSetMode:
		mode := nvml.DEVICE_MIG_DISABLE
		if s.Enable {
			mode = nvml.DEVICE_MIG_ENABLE
		}
		activation, ret := dev.SetMigMode(mode)
		switch {
		case ret == nvml.ERROR_IN_USE:
			return State{Phase: PhasePending, Reason: "MIG mode change waits for the GPU's instances to go"}, nil
		case ret != nvml.SUCCESS:
			return State{}, fmt.Errorf("SetMigMode: %w", ret)
		case activation == nvml.ERROR_RESET_REQUIRED:
			return State{Phase: PhaseResetRequired, Reason: fmt.Sprintf("MIG mode change to enabled=%t waits for a GPU reset", s.Enable)}, nil
		case activation == nvml.ERROR_IN_USE:
			return State{Phase: PhasePending, Reason: "MIG mode change waits for the processes on the GPU to exit"}, nil
		case activation != nvml.SUCCESS:
			return State{}, fmt.Errorf("SetMigMode activation: %w", activation)
		}
		return State{}, nil
	case OpDestroy:
		for _, u := range s.UUIDs {
			if h, ok := p.Held[u]; ok {
				return State{Phase: PhasePending, Reason: fmt.Sprintf("%s held by %s", u, h)}, nil
			}
		}
		if len(s.UUIDs) > 0 && p.DestroyBlocked != "" {
			return State{Phase: PhasePending, Reason: p.DestroyBlocked}, nil
		}
		_, gi, err := findGI(dev, s)
		if err != nil || gi == nil {
			return State{}, err // nil, nil: already gone
		}
		cis, err := computeInstances(gi)
		if err != nil {
			return State{}, err
		}
		if s.Bare && len(cis) > 0 {
			a.log.Info("GPU instance has a compute instance now; left as it is", "gpu", p.GPU, "uuid", p.UUID, "step", s.String())
			return State{}, nil
		}
		for _, ci := range cis {
			if ret := ci.Destroy(); ret != nvml.SUCCESS {
				return State{}, fmt.Errorf("destroy compute instance: %w", ret)
			}
		}
		if a.crashAt("mid", k) {
			return State{}, errCrashed
		}
		if ret := gi.Destroy(); ret != nvml.SUCCESS {
			return State{}, fmt.Errorf("destroy gpu instance: %w", ret)
		}
		return State{}, nil
	case OpCreate:
		info, gi, err := findGI(dev, s)
		if err != nil {
			return State{}, err
		}
		if gi == nil {
			pl := nvml.GpuInstancePlacement{Start: uint32(s.Placement.Start), Size: uint32(s.Placement.Size)}
			var ret nvml.Return
			if gi, ret = dev.CreateGpuInstanceWithPlacement(&info, &pl); ret != nvml.SUCCESS {
				return State{}, fmt.Errorf("CreateGpuInstanceWithPlacement: %w", ret)
			}
		}
		if a.crashAt("mid", k) {
			return State{}, errCrashed
		}
		cis, err := computeInstances(gi)
		if err == nil && len(cis) > 0 {
			return State{}, nil // adopted from a run that died after this step
		}
		if err == nil {
			err = createFullCI(gi, info.SliceCount)
		}
		if err != nil {
			// Undo the GPU instance: one without a compute instance is no MIG
			// device, so no pod can use it, yet it holds its slices. Should
			// the compute instances be unknown and exist after all, NVML
			// refuses (IN_USE) and the instance stays whole.
			if ret := gi.Destroy(); ret != nvml.SUCCESS {
				return State{}, fmt.Errorf("%w (and removing its gpu instance: %w)", err, ret)
			}
			return State{}, err
		}
		return State{}, nil
	}
	return State{}, fmt.Errorf("unknown op %q", s.Op)
}

// findGI returns the profile info of s and the GPU instance of that profile
// at s.Placement, or a nil instance when there is none.
func findGI(dev nvml.Device, s Step) (nvml.GpuInstanceProfileInfo, nvml.GpuInstance, error) {
	info, ret := dev.GetGpuInstanceProfileInfo(s.ProfileIndex)
	if ret != nvml.SUCCESS {
		return info, nil, fmt.Errorf("GetGpuInstanceProfileInfo(%d): %w", s.ProfileIndex, ret)
	}
	gis, ret := dev.GetGpuInstances(&info)
	if ret != nvml.SUCCESS {
		return info, nil, fmt.Errorf("GetGpuInstances(%s): %w", s.Profile, ret)
	}
	for _, gi := range gis {
		gii, ret := gi.GetInfo()
		if ret != nvml.SUCCESS {
			return info, nil, fmt.Errorf("gpu instance GetInfo: %w", ret)
		}
		if int(gii.Placement.Start) == s.Placement.Start {
			return info, gi, nil
		}
	}
	return info, nil, nil
}

func computeInstances(gi nvml.GpuInstance) ([]nvml.ComputeInstance, error) {
	var out []nvml.ComputeInstance
	for p := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		info, ret := gi.GetComputeInstanceProfileInfo(p, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("GetComputeInstanceProfileInfo(%d): %w", p, ret)
		}
		cis, ret := gi.GetComputeInstances(&info)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("GetComputeInstances(%d): %w", p, ret)
		}
		out = append(out, cis...)
	}
	return out, nil
}

// createFullCI creates the compute instance that spans the GPU instance; the
// CI profile is found by slice count, as profile ids differ between drivers.
// A profile NVML fails to describe is an error, not a profile that does not
// fit: it may be the one that spans.
func createFullCI(gi nvml.GpuInstance, slicesWanted uint32) error {
	for p := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		info, ret := gi.GetComputeInstanceProfileInfo(p, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if ret != nvml.SUCCESS {
			return fmt.Errorf("GetComputeInstanceProfileInfo(%d): %w", p, ret)
		}
		if info.SliceCount != slicesWanted {
			continue
		}
		if _, ret := gi.CreateComputeInstance(&info); ret != nvml.SUCCESS {
			return fmt.Errorf("CreateComputeInstance(%d slices): %w", slicesWanted, ret)
		}
		return nil
	}
	return fmt.Errorf("no compute instance profile spans %d slices", slicesWanted)
}

// abandon drops a journal whose layout is no longer wanted. A step cut short
// leaves at most a GPU instance without a compute instance (inside a create
// or a destroy); the plan replacing this one was made from an inventory that
// lists it (gpu.GPU.GIsWithoutCI) and destroys it. The half of a create is
// removed here as well, for a caller whose plan came from an older snapshot.
func (a *Applier) abandon(dev nvml.Device, j *journal) error {
	if j.Next < len(j.Plan.Steps) && j.Plan.Steps[j.Next].Op == OpCreate {
		_, gi, err := findGI(dev, j.Plan.Steps[j.Next])
		if err != nil {
			return err
		}
		if gi != nil {
			cis, err := computeInstances(gi)
			if err != nil {
				return err
			}
			if len(cis) == 0 {
				if ret := gi.Destroy(); ret != nvml.SUCCESS {
					return fmt.Errorf("remove half-created gpu instance: %w", ret)
				}
			}
		}
	}
	return a.remove(j.Plan.UUID)
}

func (a *Applier) path(uuid string) string { return filepath.Join(a.dir, uuid+".json") }

// maxJournalBytes bounds a journal read back: a plan of a few dozen steps
// is a few kilobytes.
const maxJournalBytes = 1 << 20

// load reads the journal of GPU uuid; nil when there is none, or when what
// is there cannot be trusted: a torn, foreign or inconsistent journal (or
// not a regular file) is set aside with a warning, and planning starts
// from NVML, which is safe because every step is idempotent and creates
// are whole. A journal of a newer major format is an error, and left in
// place: the plan in flight is the newer agent's to finish, and this
// build cannot tell what its steps mean.
func (a *Applier) load(uuid string) (*journal, error) {
	path := a.path(uuid)
	b, err := atomicfile.ReadFile(path, maxJournalBytes)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	var j *journal
	if err == nil {
		j, err = decodeJournal(b, uuid)
	}
	var newer *stateformat.NewerError
	switch {
	case errors.As(err, &newer):
		return nil, fmt.Errorf("MIG journal %s: %w; the GPU is left as it is until the agent that wrote it finishes its plan (or the file is removed)", path, err)
	case err != nil:
		aside, err := atomicfile.SetAside(path, err)
		if aside == "" {
			return nil, fmt.Errorf("MIG journal %w", err)
		}
		a.log.Warn("MIG journal not trusted; set aside, planning from what NVML shows", "path", path, "aside", aside, "error", err)
		return nil, nil
	}
	return j, nil
}

// decodeJournal reads a journal and checks that it can be resumed: its
// plan is for GPU uuid, and Next points at a step of it (or just past the
// last).
func decodeJournal(b []byte, uuid string) (*journal, error) {
	var j journal
	if _, err := journalFormat.Decode(b, &j); err != nil {
		return nil, err
	}
	switch {
	case j.Plan.UUID != uuid:
		return nil, fmt.Errorf("plan for GPU %q, not %s", j.Plan.UUID, uuid)
	case j.Next < 0 || j.Next > len(j.Plan.Steps):
		return nil, fmt.Errorf("next step %d of a plan of %d steps", j.Next, len(j.Plan.Steps))
	}
	for i, s := range j.Plan.Steps {
		if err := s.check(); err != nil {
			return nil, fmt.Errorf("step %d: %w", i, err)
		}
	}
	return &j, nil
}

// save writes the journal atomically, so a crash leaves either the old or
// the new progress, never a torn file.
func (a *Applier) save(j *journal) error {
	if err := os.MkdirAll(a.dir, 0o755); err != nil {
		return fmt.Errorf("MIG journal dir: %w", err)
	}
	// In this build's format, whatever the one resumed was in: a newer
	// minor's fields were not kept.
	j.Version, j.Minor = 0, 0
	if v := journalFormat.Current(); v != journalFormat.Unversioned {
		j.Version, j.Minor = v.Major, v.Minor
	}
	b, err := json.Marshal(j)
	if err != nil {
		return fmt.Errorf("encode MIG journal: %w", err)
	}
	if err := a.write(a.path(j.Plan.UUID), b); err != nil {
		return fmt.Errorf("write MIG journal: %w", err)
	}
	return nil
}

func (a *Applier) remove(uuid string) error {
	if err := os.Remove(a.path(uuid)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove MIG journal: %w", err)
	}
	return nil
}
