package health

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// AllInstances in Cause.GI or Cause.CI means the cause is not limited to one
// GPU instance (GI) or compute instance (CI).
const AllInstances = -1

// CauseKind says what raised a Cause.
type CauseKind string

// Cause kinds.
const (
	CauseXID           CauseKind = "xid"
	CauseDoubleBitECC  CauseKind = "ecc-double-bit"
	CauseLost          CauseKind = "gpu-lost"
	CauseResetRequired CauseKind = "reset-required"
	// Found by reading NVML when a GPU is first seen (and judged by the
	// same reads afterwards).
	CauseRecoveryAction CauseKind = "recovery-action"
	CauseRemapPending   CauseKind = "row-remap-pending"
	CauseRemapFailure   CauseKind = "row-remap-failure"
	CauseRetiredPending CauseKind = "page-retirement-pending"
)

// Cause is one active reason for devices of a GPU to be unhealthy.
type Cause struct {
	// GPU is the physical GPU's UUID; Index its NVML index.
	GPU   string `json:"gpu"`
	Index int    `json:"index"`
	// GI and CI limit the cause to MIG devices of one GPU instance (and one
	// compute instance); AllInstances when it concerns the whole GPU.
	GI    int       `json:"gi"`
	CI    int       `json:"ci"`
	Kind  CauseKind `json:"kind"`
	XID   uint64    `json:"xid,omitempty"`
	Class Class     `json:"class"`
	// Since is the first occurrence, Last the latest; Count how many merged.
	Since  time.Time `json:"since"`
	Last   time.Time `json:"last"`
	Count  int       `json:"count"`
	Reason string    `json:"reason"`
}

// GPUWide reports whether the cause concerns every device of its GPU.
func (c Cause) GPUWide() bool { return c.GI == AllInstances }

func (c Cause) covers(gi, ci int) bool {
	return c.GI == AllInstances || (c.GI == gi && (c.CI == AllInstances || c.CI == ci))
}

// Entry is one line of the health event log: what happened and why a device
// changed state (or did not).
type Entry struct {
	Time    time.Time `json:"time"`
	GPU     string    `json:"gpu"`
	Index   int       `json:"index"`
	Action  string    `json:"action"` // one of the Action* constants
	Message string    `json:"message"`
}

// Entry actions.
const (
	ActionUnhealthy = "unhealthy"
	ActionHealthy   = "healthy"
	ActionIgnored   = "ignored"
)

// GPUStats counts what the watcher saw on one GPU since it started.
type GPUStats struct {
	Index int
	// LastXID is the latest XID (fatal or not), 0 before the first.
	LastXID uint64
	// XIDs counts events per XID.
	XIDs            map[uint64]uint64
	SingleBitEvents uint64
	DoubleBitEvents uint64
}

type migRef struct {
	gpu    string
	gi, ci int
}

// State is an immutable snapshot of device health. The zero State (and nil)
// has every device healthy.
type State struct {
	// Causes are all active causes, by GPU index then severity.
	Causes []Cause
	// Log is the recent event log, oldest first.
	Log []Entry

	byGPU map[string][]Cause
	mig   map[string]migRef
	stats map[string]GPUStats
	saved []SavedCause
}

// Unhealthy reports whether the device with this ID is unhealthy, and why.
// id is a GPU UUID, a MIG device UUID or a replica ID ("<uuid>::<n>"): a
// replica shares its device's health, a MIG device its parent GPU's and its
// own GPU/compute instance's.
func (s *State) Unhealthy(id string) (reason string, bad bool) {
	if s == nil {
		return "", false
	}
	base, _, _ := strings.Cut(id, "::")
	if causes, ok := s.byGPU[base]; ok {
		for _, c := range causes {
			if c.GPUWide() {
				return c.Reason, true
			}
		}
		return "", false
	}
	if m, ok := s.mig[base]; ok {
		for _, c := range s.byGPU[m.gpu] {
			if c.covers(m.gi, m.ci) {
				return c.Reason, true
			}
		}
	}
	return "", false
}

// UnhealthyDevices maps every unhealthy GPU and MIG device UUID the watcher
// knows to its reason (replica IDs are left to Unhealthy).
func (s *State) UnhealthyDevices() map[string]string {
	out := map[string]string{}
	if s == nil {
		return out
	}
	for uuid := range s.byGPU {
		if r, bad := s.Unhealthy(uuid); bad {
			out[uuid] = r
		}
	}
	for uuid := range s.mig {
		if r, bad := s.Unhealthy(uuid); bad {
			out[uuid] = r
		}
	}
	return out
}

// CausesOf returns the active causes of a GPU by UUID, most severe first.
func (s *State) CausesOf(gpuUUID string) []Cause {
	if s == nil {
		return nil
	}
	return s.byGPU[gpuUUID]
}

// Stats returns the event counts of a GPU by UUID.
func (s *State) Stats(gpuUUID string) (GPUStats, bool) {
	if s == nil {
		return GPUStats{}, false
	}
	st, ok := s.stats[gpuUUID]
	return st, ok
}

func (c Cause) String() string {
	scope := "whole GPU"
	if !c.GPUWide() {
		scope = fmt.Sprintf("GI %d", c.GI)
		if c.CI != AllInstances {
			scope += fmt.Sprintf(" CI %d", c.CI)
		}
	}
	return fmt.Sprintf("gpu %d (%s) %s: %s", c.Index, c.GPU, scope, c.Reason)
}

// SavedCause is an active cause as checkpointed across an agent restart:
// the cause and the evidence its recovery is judged by. Without the evidence
// a restarted agent could not tell that a GPU was reset while it was down
// (its volatile ECC count dropped, its recovery action cleared).
type SavedCause struct {
	Cause
	// DBEMax is the highest volatile double-bit ECC count seen while the
	// cause was active (DBEKnown: it was read).
	DBEMax   uint64 `json:"dbeMax,omitempty"`
	DBEKnown bool   `json:"dbeKnown,omitempty"`
	// ActionSeen: NVML reported a pending recovery action while active.
	ActionSeen bool `json:"actionSeen,omitempty"`
	// SawDown: the GPU was seen unreachable while active.
	SawDown bool `json:"sawDown,omitempty"`
	// Boot is the node's boot id when the cause was raised: after a
	// reboot (another boot id) it is not restored, as the reboot reset the
	// GPU. Empty: unknown (restored).
	Boot string `json:"boot,omitempty"`
}

// Saved returns the active causes with their evidence, for a checkpoint.
func (s *State) Saved() []SavedCause {
	if s == nil {
		return nil
	}
	return s.saved
}

// RestoredState is the State a checkpoint describes, for use before the
// watcher has read the GPUs again: devices of a GPU with a GPU-wide cause
// are unhealthy. MIG-scoped causes take effect once the watcher knows the
// GPU's instances. boot is the node's boot id ("" unknown): causes of
// another boot are left out, as the watcher leaves them out (a reboot
// cleared them).
func RestoredState(saved []SavedCause, boot string) *State {
	saved = slices.DeleteFunc(slices.Clone(saved), func(c SavedCause) bool {
		return boot != "" && c.Boot != "" && c.Boot != boot
	})
	s := &State{byGPU: map[string][]Cause{}, mig: map[string]migRef{}, stats: map[string]GPUStats{}, saved: saved}
	for _, c := range saved {
		s.byGPU[c.GPU] = append(s.byGPU[c.GPU], c.Cause)
		s.Causes = append(s.Causes, c.Cause)
	}
	return s
}
