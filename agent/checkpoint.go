package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/stateformat"
)

// CheckpointFile is the checkpoint's name in --state-dir.
const CheckpointFile = "checkpoint.json"

// CheckpointVersion is the major version of the format written
// (checkpointFormat). A file of a major version this build does not read
// is not trusted: guessing at fields that changed meaning could mark
// healthy GPUs unhealthy or, worse, forget a held device.
const CheckpointVersion = 4

// checkpointFormat is the checkpoint's format: "version" the major, "minor"
// the minor (absent: 0). The majors before: 1 had no DRA claims; 2 kept
// the device plugin's allocations here (now in the allocation log) and
// intents among the releases; 3 had no cordon and no GPUs touched by MIG
// plans. All read as version 4. 4.1 added Spares. A newer 4.x is read
// without the fields it added; a newer major is refused, and left in place.
var checkpointFormat = stateformat.Format{Reads: []stateformat.Version{{Major: 1}, {Major: 2}, {Major: 3}, {Major: CheckpointVersion, Minor: 1}}}

// maxCheckpointBytes bounds what is read back: the checkpoint holds a few
// records per GPU and device, so anything larger is not ours.
const maxCheckpointBytes = 8 << 20

// Checkpoint is what must survive an agent restart: the GPUs last seen (so
// one lost at start is offered unhealthy, not dropped), the ledger's DRA
// side (prepared claims, intents, releases), the active health causes
// with the evidence their recovery is judged by, the cordoned GPUs, and the
// GPUs MIG plans changed since they were last read whole. The device plugin's
// allocations are in the allocation log (AllocLogFile), written before
// Allocate answers.
type Checkpoint struct {
	// Version and Minor are the format's version (checkpointFormat).
	Version int       `json:"version"`
	Minor   int       `json:"minor,omitempty"`
	Node    string    `json:"node,omitempty"`
	Written time.Time `json:"written"`
	GPUs    []gpu.GPU `json:"gpus,omitempty"`
	// Allocated maps device UUIDs to when the plugin allocated them
	// (versions 1 and 2 only; read, never written).
	Allocated map[string]time.Time `json:"allocated,omitempty"`
	Health    []health.SavedCause  `json:"health,omitempty"`
	// Claims are the prepared DRA claims, by claim UID (version 2);
	// Releasing what claims left on the node that is still to be undone
	// (MIG devices, CDI specs); Intents the MIG devices being made for
	// claims (version 3; in Releasing before); DynamicMIG the GPUs whose
	// MIG mode a claim turned on.
	Claims     map[types.UID]PreparedClaim `json:"claims,omitempty"`
	Releasing  map[types.UID]PreparedClaim `json:"releasing,omitempty"`
	Intents    map[types.UID]PreparedClaim `json:"intents,omitempty"`
	DynamicMIG []string                    `json:"dynamicMIG,omitempty"`
	// FailedSince is when each GPU that could not be read (listed in GPUs)
	// first was: a GPU gone for good is forgotten that long after, however
	// often the agent restarts (version 3).
	FailedSince map[string]time.Time `json:"failedSince,omitempty"`
	// Cordon is the Node's cordon annotation as last heard (UUIDs or
	// indices, as written; version 4). Until the Node watch answers after
	// a restart it is the only word on which GPUs are out of service:
	// without it the first catalog and DRA pool would offer them.
	Cordon []string `json:"cordon,omitempty"`
	// MIGTouched are the GPUs MIG plans ran on that were not read whole
	// since (version 4). Their records in GPUs do not say what NVML has
	// now (one from before a plan has the devices it destroyed), so a
	// restarted agent offers them failed, with no MIG device, until it
	// reads them whole, as the agent before it did.
	MIGTouched []string `json:"migTouched,omitempty"`
	// Spares, under migOnDemand.spareLayout, is what each chosen GPU
	// offered (version 4.1): whole, or its layout, or on its way from one
	// to the other since a time. Without it a restarted agent cannot tell
	// which the scheduler may have given out, and offers both, tainted,
	// for the grace.
	Spares *SavedSpares `json:"spares,omitempty"`
}

// SavedSpares is a checkpoint's record of the spare GPUs under
// spareLayout: Open those offering their layout (with when each was found
// surplus, zero if not), Opening those offered whole, tainted, since the
// time given, before their layout replaces it. A chosen GPU in neither is
// offered whole.
type SavedSpares struct {
	Open    map[string]time.Time `json:"open"`
	Opening map[string]time.Time `json:"opening,omitempty"`
}

// LoadCheckpoint reads dir's checkpoint. A missing file is (nil, nil). An
// unreadable, torn or foreign one is set aside (atomicfile.SetAside) and
// reported as an error; the agent then starts from what NVML shows. One of
// a newer major format is left where it is, for the newer agent that wrote
// it, and the error wraps a *stateformat.NewerError: the agent refuses to
// start on it rather than forget what it records.
func LoadCheckpoint(dir string) (*Checkpoint, error) {
	path := filepath.Join(dir, CheckpointFile)
	// Only a regular file is read: a FIFO would block the start forever
	// (before any listener, deaf to SIGTERM), a device never end.
	b, err := atomicfile.ReadFile(path, maxCheckpointBytes)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	var cp *Checkpoint
	if err == nil {
		cp, err = DecodeCheckpoint(b)
	}
	var newer *stateformat.NewerError
	switch {
	case errors.As(err, &newer):
		return nil, fmt.Errorf("checkpoint %s: %w; left as it is for the agent that wrote it (roll forward to it, or remove the file to start without the claims and health causes it records)", path, err)
	case err != nil:
		_, err := atomicfile.SetAside(path, err)
		return nil, fmt.Errorf("checkpoint %w", err)
	}
	return cp, nil
}

// DecodeCheckpoint reads a checkpoint's bytes: one JSON object of a
// version this agent reads, strictly (no field it does not know) but for a
// newer minor version, whose added fields it skips.
func DecodeCheckpoint(b []byte) (*Checkpoint, error) {
	var cp Checkpoint
	if _, err := checkpointFormat.Decode(b, &cp); err != nil {
		return nil, err
	}
	return &cp, nil
}

// restore takes what the last agent checkpointed.
func (a *Agent) restore(cp *Checkpoint) {
	if cp == nil {
		return
	}
	if cp.Node != "" && a.opts.NodeName != "" && cp.Node != a.opts.NodeName {
		a.log.Warn("checkpoint is from another node; ignoring it", "checkpoint-node", cp.Node, "node", a.opts.NodeName)
		return
	}
	future := a.ledger.Restore(ledger.Snapshot{Claims: cp.Claims, Releasing: cp.Releasing, Intents: cp.Intents,
		DynamicMIG: cp.DynamicMIG, Allocated: cp.Allocated})
	if future > 0 {
		a.log.Warn("allocations dated after now (the clock stepped back since they were made) count from now", "allocations", future)
	}
	a.failedSince = maps.Clone(cp.FailedSince)
	// The Node watch's first answer replaces it (CordonChanged), as any
	// later one does.
	a.cordoned = slices.Clone(cp.Cordon)
	if sp := cp.Spares; sp != nil {
		a.spares = spares{open: maps.Clone(sp.Open), opening: maps.Clone(sp.Opening), layout: true}
		if a.spares.open == nil {
			a.spares.open = map[string]time.Time{}
		}
	}
	for _, uuid := range cp.MIGTouched {
		// Only a GPU the checkpoint has a record of: the set is about
		// which records not to believe.
		if slices.ContainsFunc(cp.GPUs, func(g gpu.GPU) bool { return g.UUID == uuid }) {
			if a.migTouched == nil {
				a.migTouched = map[string]bool{}
			}
			a.migTouched[uuid] = true
		}
	}
	if len(cp.GPUs) > 0 {
		// What the last agent believed, as the base the first read settles
		// against: a GPU that cannot be read now is then offered unhealthy
		// instead of vanishing from the kubelet.
		a.inv = &gpu.Inventory{GPUs: cp.GPUs, Topology: gpu.EmptyTopology(len(cp.GPUs))}
		a.ledger.SetInventory(cp.GPUs)
	}
	if len(cp.Health) > 0 {
		// Until the watcher reports, plan with the causes that were in
		// force: otherwise the first catalog would offer them healthy.
		a.health = health.RestoredState(cp.Health, a.opts.BootID)
	}
	a.log.Info("checkpoint restored", "written", cp.Written, "gpus", len(cp.GPUs),
		"allocations", len(cp.Allocated), "healthCauses", len(cp.Health), "draClaims", len(cp.Claims), "draReleasing", len(cp.Releasing), "draIntents", len(cp.Intents), "cordon", cp.Cordon, "migTouched", cp.MIGTouched)
}

// checkpoint writes the checkpoint when its content changed; the error says
// why it could not.
func (a *Agent) checkpoint() error {
	if a.opts.StateDir == "" {
		return nil
	}
	held := a.ledger.Snapshot()
	cp := Checkpoint{Version: CheckpointVersion, Node: a.opts.NodeName, Claims: held.Claims,
		Releasing: held.Releasing, Intents: held.Intents, DynamicMIG: held.DynamicMIG,
		Cordon: a.cordoned, MIGTouched: slices.Sorted(maps.Keys(a.migTouched))}
	// A file names the oldest minor that holds what it has: a node that
	// keeps no spare record can still roll back to a build of 4.0, which
	// refuses any minor.
	if a.spares.layout && a.spares.open != nil {
		cp.Spares, cp.Minor = &SavedSpares{Open: a.spares.open, Opening: a.spares.opening}, 1
	}
	if a.inv != nil {
		cp.GPUs = a.inv.GPUs
		for _, uuid := range slices.Sorted(maps.Keys(a.failed)) {
			f := a.failed[uuid]
			cp.GPUs = append(cp.GPUs, f.GPU)
			if cp.FailedSince == nil {
				cp.FailedSince = map[string]time.Time{}
			}
			cp.FailedSince[uuid] = f.Since
		}
	}
	if a.health != nil {
		cp.Health = a.health.Saved()
	}
	body, err := json.Marshal(cp)
	if err != nil {
		a.log.Error("checkpoint not written", "error", err)
		return err
	}
	if bytes.Equal(body, a.saved) {
		// The file holds this already: a write that failed since, for
		// content that changed back, left nothing unsaved.
		if a.ckptErr.clear() {
			a.log.Info("checkpoint on disk holds the state again", "path", filepath.Join(a.opts.StateDir, CheckpointFile))
		}
		return nil
	}
	cp.Written = a.now()
	out, err := json.MarshalIndent(cp, "", " ")
	if err == nil {
		err = a.opts.WriteState(filepath.Join(a.opts.StateDir, CheckpointFile), out)
	}
	if err != nil {
		a.metrics.ckptFailures.Add(1)
		if a.ckptErr.set(err, a.now()) {
			a.log.Error("checkpoint not written; a restart would forget DRA claims and health causes (retried at every pass)", "error", err)
		}
		return err
	}
	if a.ckptErr.clear() {
		a.log.Info("checkpoint written again", "path", filepath.Join(a.opts.StateDir, CheckpointFile))
	}
	a.saved, a.ckptWritten = body, cp.Written
	return nil
}

// stateStatus says whether what must survive a restart is on disk: the
// checkpoint, and the allocation log (nil without a state dir).
func (a *Agent) stateStatus() *StateStatus {
	if a.opts.StateDir == "" {
		return nil
	}
	st := &StateStatus{Dir: a.opts.StateDir, CheckpointWritten: a.ckptWritten}
	var errs []string
	if a.ckptErr.stands() {
		errs = append(errs, "checkpoint: "+a.ckptErr.err.Error())
		st.ErrorSince = a.ckptErr.since
	}
	if err, since := a.ledger.LogError(); err != nil {
		errs = append(errs, "allocation log: "+err.Error())
		if st.ErrorSince.IsZero() || since.Before(st.ErrorSince) {
			st.ErrorSince = since
		}
	}
	st.Error = strings.Join(errs, "; ")
	if st.Error != "" {
		a.metrics.stateSaved.Set(0)
	} else {
		a.metrics.stateSaved.Set(1)
	}
	return st
}
