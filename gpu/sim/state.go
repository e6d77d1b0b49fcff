package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/gpu-agent/gpu-agent/atomicfile"
)

// stateVersion is the state file format this build writes and reads.
const stateVersion = 1

// maxStateBytes bounds what a state file may hold: a profile with every GPU
// split into 1-slice instances writes about 31 KB, 16 GPUs with
// maxProcsPerGPU busy processes each about 560 KB, and a path that names
// something else (a log, a device) must not fill memory.
const maxStateBytes = 1 << 20

// maxStructurePerGPU bounds the JSON values a state file may hold per GPU,
// counted as the ',', '{' and '[' that separate or open them: a GPU split
// into seven instances, each with its compute instance, takes 123, and each
// process 8 more (maxProcsPerGPU of them). The count
// is checked before decoding, as encoding/json makes a record of every list
// item, even after a type error: some 200 bytes for each 2 bytes of "{},".
const maxStructurePerGPU = 2048

// WithStateFile keeps the node's GPU state in the file at path, so that it
// outlives the process as a real GPU's does across an agent restart: MIG
// modes, GPU and compute instances (with their ids, placements and hence
// MIG device UUIDs), lost GPUs, ECC counters, recovery actions and remapped
// rows, and the compute processes running (StartProcess), which outlive the
// agent as real ones do, with their load. Other telemetry is not kept.
//
// When the file exists New loads it instead of the profile's initial layout
// (WithMIGEnabled then changes nothing); when it does not, New starts from
// the profile and writes it. Every call that changes kept state writes the
// file (atomically, synced) before it returns. If that write fails the call
// changes nothing: NVML calls return ERROR_UNKNOWN (NVML has no code that
// says why; the node logs it), the Go fault setters return the error.
//
// One process at a time may use a state file; see Close. An empty path
// means no state file.
func WithStateFile(path string) Option { return func(o *options) { o.statePath = path } }

// WithState starts the node from data, a state file's content (see
// WithStateFile and State), instead of the profile's initial layout, and
// keeps what changes in memory only: no file is locked or written. It makes
// a copy of a node, one another process may be running, to try changes on
// without touching it (gpu-agent config validate shows a layout applied).
func WithState(data []byte) Option { return func(o *options) { o.state = data } }

// State returns the node's kept state as its state file holds it; New with
// WithState builds a copy of the node from it.
func (n *Node) State() ([]byte, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	data, err := json.MarshalIndent(n.record(), "", "  ")
	if err != nil {
		return nil, fmt.Errorf("sim %s: encode state: %w", n.spec.name, err)
	}
	return append(data, '\n'), nil
}

// StateProfile returns the profile a state (see State) was written for, so
// a copy can be built from the state alone.
func StateProfile(data []byte) (string, error) {
	var head struct {
		Profile string `json:"profile"`
	}
	if err := json.Unmarshal(data, &head); err != nil {
		return "", fmt.Errorf("sim state: corrupt (torn or not JSON): %w", err)
	}
	if head.Profile == "" {
		return "", errors.New(`sim state: no "profile"`)
	}
	return head.Profile, nil
}

// stateFile is the JSON document of a state file.
type stateFile struct {
	Version int    `json:"version"`
	Profile string `json:"profile"`
	// BootID is the node's boot (Node.BootID); a file written before
	// there were boots has none, and the node starts a new one.
	BootID string      `json:"boot_id,omitempty"`
	GPUs   []gpuRecord `json:"gpus"`
}

type gpuRecord struct {
	Index int `json:"index"`
	// UUID is checked on load, so a file edited or swapped between nodes
	// of one profile cannot go unnoticed.
	UUID         string     `json:"uuid"`
	Lost         bool       `json:"lost"`
	MIGCurrent   bool       `json:"mig_current"`
	MIGPending   bool       `json:"mig_pending"`
	GPUInstances []giRecord `json:"gpu_instances"`
	ECC          eccRecord  `json:"ecc"`
	// RecoveryAction is an nvml.DeviceGpuRecoveryAction.
	RecoveryAction int32       `json:"recovery_action"`
	RemappedRows   remapRecord `json:"remapped_rows"`
	// Processes are left out when there are none, so files written
	// before processes were kept read the same.
	Processes []procRecord `json:"processes,omitempty"`
	// Fabric is the GPU's FabricFault, left out when there is none (and
	// on profiles that are not fabric-attached).
	Fabric *fabricRecord `json:"fabric,omitempty"`
}

// procRecord is a Process.
type procRecord struct {
	PID uint32 `json:"pid"`
	// GI and CI are 4294967295 (NoInstance) on a whole GPU.
	GI          uint32 `json:"gi"`
	CI          uint32 `json:"ci"`
	MPS         bool   `json:"mps,omitempty"`
	MemoryBytes uint64 `json:"memory_bytes"`
	SM          uint32 `json:"sm_util,omitempty"`
	Mem         uint32 `json:"mem_util,omitempty"`
	Cgroup      string `json:"cgroup,omitempty"`
	Enc         uint32 `json:"enc_util,omitempty"`
	Dec         uint32 `json:"dec_util,omitempty"`
}

type giRecord struct {
	ID int `json:"id"`
	// ProfileID is the id NVML reports (19 for A100 1g.5gb); Profile, its
	// name, is for people reading the file and must agree with it.
	ProfileID        uint32          `json:"profile_id"`
	Profile          string          `json:"profile"`
	Placement        placementRecord `json:"placement"`
	ComputeInstances []ciRecord      `json:"compute_instances"`
}

type ciRecord struct {
	ID int `json:"id"`
	// ProfileID is a COMPUTE_INSTANCE_PROFILE_* value.
	ProfileID uint32          `json:"profile_id"`
	Placement placementRecord `json:"placement"`
	// UUID is the MIG device's. It follows from the profile, GPU index and
	// GI/CI ids; it is written for people and checked on load.
	UUID string `json:"uuid"`
}

type placementRecord struct {
	Start uint32 `json:"start"`
	Size  uint32 `json:"size"`
}

type eccRecord struct {
	CorrectedVolatile    uint64 `json:"corrected_volatile"`
	CorrectedAggregate   uint64 `json:"corrected_aggregate"`
	UncorrectedVolatile  uint64 `json:"uncorrected_volatile"`
	UncorrectedAggregate uint64 `json:"uncorrected_aggregate"`
}

type remapRecord struct {
	Corrected   int  `json:"corrected"`
	Uncorrected int  `json:"uncorrected"`
	Pending     bool `json:"pending"`
	Failure     bool `json:"failure"`
}

// stateStore is a node's state file. Guarded by Node.mu.
type stateStore struct {
	path string
	lock *os.File // nil once closed
	// written is what the file holds, so that calls changing nothing kept
	// (telemetry setters, failed NVML calls) do not write it.
	written []byte
}

// openState locks the state file at path and reads it; data is nil when
// the file does not exist yet.
func openState(path string) (s *stateStore, data []byte, err error) {
	lock, err := lockState(path)
	if err != nil {
		return nil, nil, err
	}
	s = &stateStore{path: path, lock: lock}
	removeStaleTemps(path)
	data, err = readState(path)
	if errors.Is(err, fs.ErrNotExist) {
		return s, nil, nil
	}
	if err != nil {
		s.close()
		return nil, nil, err
	}
	return s, data, nil
}

// readState reads the state file at path, at most maxStateBytes of it.
func readState(path string) ([]byte, error) {
	data, err := atomicfile.ReadFile(path, maxStateBytes)
	if errors.Is(err, atomicfile.ErrTooLarge) {
		return nil, fmt.Errorf("larger than %d bytes, not a state file", maxStateBytes)
	}
	return data, err
}

// removeStaleTemps deletes temporary files of writes a killed process left
// behind; holding the lock, no other process can be writing one.
func removeStaleTemps(path string) {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return // the write that needs the directory will report it
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), base+".tmp-") {
			_ = os.Remove(filepath.Join(dir, e.Name())) // best effort: litter, not state
		}
	}
}

func (s *stateStore) close() error {
	if s == nil || s.lock == nil {
		return nil
	}
	err := s.lock.Close() // closing the descriptor releases the flock
	s.lock = nil
	return err
}

// Close releases the node's state file (see WithStateFile) for another
// process or Node; afterwards calls that would change kept state fail as
// when the file cannot be written. Without a state file it does nothing.
// A process that exits without Close releases the file too.
func (n *Node) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.store.close()
}

// persist writes the node's kept state to its state file when it differs
// from what the file holds; callers hold n.mu.
func (n *Node) persist() error {
	if n.store == nil {
		return nil
	}
	data, err := json.MarshalIndent(n.record(), "", "  ")
	if err != nil {
		return fmt.Errorf("state file %s: encode: %w", n.store.path, err)
	}
	data = append(data, '\n')
	if bytes.Equal(data, n.store.written) {
		return nil
	}
	if n.store.lock == nil {
		return fmt.Errorf("state file %s: node closed", n.store.path)
	}
	if err := atomicfile.Write(n.store.path, data); err != nil {
		return fmt.Errorf("state file %s: %w", n.store.path, err)
	}
	n.store.written = data
	return nil
}

// record is the node's kept state; callers hold n.mu.
func (n *Node) record() stateFile {
	st := stateFile{Version: stateVersion, Profile: n.spec.name, BootID: n.boot, GPUs: make([]gpuRecord, 0, len(n.gpus))}
	for _, g := range n.gpus {
		e := g.ecc
		rec := gpuRecord{
			Index: g.index, UUID: g.uuid, Lost: g.lost, MIGCurrent: g.migCurrent, MIGPending: g.migPending,
			GPUInstances: make([]giRecord, 0, len(g.gis)),
			ECC: eccRecord{
				CorrectedVolatile:    e[nvml.MEMORY_ERROR_TYPE_CORRECTED][nvml.VOLATILE_ECC],
				CorrectedAggregate:   e[nvml.MEMORY_ERROR_TYPE_CORRECTED][nvml.AGGREGATE_ECC],
				UncorrectedVolatile:  e[nvml.MEMORY_ERROR_TYPE_UNCORRECTED][nvml.VOLATILE_ECC],
				UncorrectedAggregate: e[nvml.MEMORY_ERROR_TYPE_UNCORRECTED][nvml.AGGREGATE_ECC],
			},
			RecoveryAction: int32(g.recovery),
			RemappedRows:   remapRecord{g.remapCorr, g.remapUnc, g.remapPending, g.remapFailure},
			Fabric:         g.fabric.record(),
		}
		for _, gi := range g.gis {
			gr := giRecord{
				ID: gi.id, ProfileID: n.profileID(gi.prof), Profile: gi.prof.name,
				Placement:        placementRecord{gi.placement.Start, gi.placement.Size},
				ComputeInstances: make([]ciRecord, 0, len(gi.cis)),
			}
			for _, ci := range gi.cis {
				gr.ComputeInstances = append(gr.ComputeInstances, ciRecord{
					ID: ci.id, ProfileID: ci.prof.Id,
					Placement: placementRecord{ci.placement.Start, ci.placement.Size}, UUID: ci.dev.uuid,
				})
			}
			rec.GPUInstances = append(rec.GPUInstances, gr)
		}
		for i := range g.procs {
			p := g.procs[i].export()
			rec.Processes = append(rec.Processes, procRecord{PID: p.PID, GI: p.GI, CI: p.CI, MPS: p.MPS,
				MemoryBytes: p.MemoryBytes, SM: p.SM, Mem: p.Mem, Enc: p.Enc, Dec: p.Dec, Cgroup: p.Cgroup})
		}
		st.GPUs = append(st.GPUs, rec)
	}
	return st
}

// load replaces the state of a freshly built node (no instances yet) with
// a state file's content. Anything this node could not have written is an
// error: starting over would silently reset "hardware" a test relies on.
func (n *Node) load(data []byte) error {
	if len(bytes.TrimSpace(data)) == 0 {
		return errors.New("file is empty (truncated?)")
	}
	if got, most := structure(data), maxStructurePerGPU*(1+len(n.gpus)); got > most {
		return fmt.Errorf("%d of ',', '{' and '[', more than a state file of %d GPUs holds (%d); refused undecoded", got, len(n.gpus), most)
	}
	// The version first, alone: a newer format may add fields the strict
	// decode below would report as the less helpful "unknown field".
	var head struct {
		Version *int `json:"version"`
	}
	if err := json.Unmarshal(data, &head); err != nil {
		return fmt.Errorf("corrupt (torn or not JSON): %w", err)
	}
	if head.Version == nil {
		return errors.New(`no "version"`)
	}
	if *head.Version != stateVersion {
		return fmt.Errorf("version %d, this build reads version %d", *head.Version, stateVersion)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var st stateFile
	if err := dec.Decode(&st); err != nil {
		return fmt.Errorf("corrupt: %w", err)
	}
	if st.Profile != n.spec.name {
		return fmt.Errorf("written for profile %q, not %q", st.Profile, n.spec.name)
	}
	if len(st.GPUs) != len(n.gpus) {
		return fmt.Errorf("%d GPUs, profile %s has %d", len(st.GPUs), n.spec.name, len(n.gpus))
	}
	for i, rec := range st.GPUs {
		if err := n.loadGPU(n.gpus[i], rec); err != nil {
			return fmt.Errorf("gpu %d: %w", i, err)
		}
	}
	if st.BootID != "" {
		n.boot = st.BootID
	}
	return nil
}

// structure counts the bytes of data that separate or open a JSON value,
// also inside strings, so it bounds the values decoding can make.
func structure(data []byte) int {
	n := 0
	for _, b := range data {
		switch b {
		case ',', '{', '[':
			n++
		}
	}
	return n
}

func (n *Node) loadGPU(g *gpuState, rec gpuRecord) error {
	m := n.spec.model
	switch {
	case rec.Index != g.index:
		return fmt.Errorf("index %d at position %d", rec.Index, g.index)
	case rec.UUID != g.uuid:
		return fmt.Errorf("uuid %q, this node's is %q", rec.UUID, g.uuid)
	case m.mig == nil && (rec.MIGCurrent || rec.MIGPending):
		return fmt.Errorf("MIG mode on, but the %s has no MIG", m.name)
	case !rec.MIGCurrent && len(rec.GPUInstances) > 0:
		return errors.New("gpu_instances with MIG mode off")
	case rec.RemappedRows.Corrected < 0 || rec.RemappedRows.Uncorrected < 0:
		return fmt.Errorf("negative remapped_rows %d/%d", rec.RemappedRows.Corrected, rec.RemappedRows.Uncorrected)
	case !m.rowRemap && rec.RemappedRows != (remapRecord{}):
		return fmt.Errorf("remapped_rows set, but the %s does not remap rows", m.name)
	case rec.Fabric != nil && !n.spec.fabric:
		return fmt.Errorf("fabric set, but profile %s is not attached to an NVLink fabric", n.spec.name)
	}
	fabric, err := rec.Fabric.fault()
	if err != nil {
		return fmt.Errorf("fabric: %w", err)
	}
	if err := fabric.validate(); err != nil {
		return fmt.Errorf("fabric: %w", err)
	}
	g.fabric = fabric
	g.lost, g.migCurrent, g.migPending = rec.Lost, rec.MIGCurrent, rec.MIGPending
	e := &g.ecc
	e[nvml.MEMORY_ERROR_TYPE_CORRECTED][nvml.VOLATILE_ECC] = rec.ECC.CorrectedVolatile
	e[nvml.MEMORY_ERROR_TYPE_CORRECTED][nvml.AGGREGATE_ECC] = rec.ECC.CorrectedAggregate
	e[nvml.MEMORY_ERROR_TYPE_UNCORRECTED][nvml.VOLATILE_ECC] = rec.ECC.UncorrectedVolatile
	e[nvml.MEMORY_ERROR_TYPE_UNCORRECTED][nvml.AGGREGATE_ECC] = rec.ECC.UncorrectedAggregate
	g.recovery = nvml.DeviceGpuRecoveryAction(rec.RecoveryAction)
	r := rec.RemappedRows
	g.remapCorr, g.remapUnc, g.remapPending, g.remapFailure = r.Corrected, r.Uncorrected, r.Pending, r.Failure
	for _, gr := range rec.GPUInstances {
		if err := n.loadGI(g, gr); err != nil {
			return fmt.Errorf("gpu instance %d: %w", gr.ID, err)
		}
	}
	// Processes last: they run on the instances just loaded. Their
	// samples start afresh, as the load in force until now is unknown.
	procs := make([]process, 0, len(rec.Processes))
	for _, p := range rec.Processes {
		procs = append(procs, process{ProcessInfo: nvml.ProcessInfo{Pid: p.PID, UsedGpuMemory: p.MemoryBytes,
			GpuInstanceId: p.GI, ComputeInstanceId: p.CI}, mps: p.MPS, sm: p.SM, mem: p.Mem, enc: p.Enc, dec: p.Dec,
			cgroup: p.Cgroup, since: n.opts.now()})
	}
	if err := n.checkProcesses(g, procs); err != nil {
		return fmt.Errorf("processes: %w", err)
	}
	g.procs = procs
	return nil
}

// loadGI recreates one GPU instance under the rules CreateGpuInstance
// enforces, so a loaded layout is one NVML could have made.
func (n *Node) loadGI(g *gpuState, gr giRecord) error {
	var p *giProfile
	for i := range n.spec.model.mig {
		if q := &n.spec.model.mig[i]; n.profileID(q) == gr.ProfileID {
			p = q
		}
	}
	pl := gr.Placement
	switch {
	case gr.ID < 1:
		return errors.New("id below 1")
	case slices.ContainsFunc(g.gis, func(gi *gpuInstance) bool { return gi.id == gr.ID }):
		return errors.New("id used twice")
	case p == nil:
		return fmt.Errorf("profile_id %d is not one of the %s's", gr.ProfileID, n.spec.model.name)
	case gr.Profile != p.name:
		return fmt.Errorf("profile %q, but profile_id %d is %s", gr.Profile, gr.ProfileID, p.name)
	case pl.Size != p.size || !slices.Contains(p.starts, pl.Start):
		return fmt.Errorf("placement %d+%d is not a %s placement", pl.Start, pl.Size, p.name)
	case g.occupied()&sliceMask(pl.Start, pl.Size) != 0:
		return fmt.Errorf("placement %d+%d overlaps another instance", pl.Start, pl.Size)
	case g.countOf(p) >= p.count:
		return fmt.Errorf("more than %d instances of %s", p.count, p.name)
	case !g.ofaLeft(p, n.spec.model):
		return fmt.Errorf("%s needs an optical flow accelerator, and the GPU has none left", p.name)
	}
	gi := n.addGI(g, gr.ID, p, pl.Start)
	for _, cr := range gr.ComputeInstances {
		if err := gi.loadCI(cr); err != nil {
			return fmt.Errorf("compute instance %d: %w", cr.ID, err)
		}
	}
	return nil
}

func (gi *gpuInstance) loadCI(cr ciRecord) error {
	pl := cr.Placement
	switch {
	case cr.ID < 0:
		return errors.New("negative id")
	case slices.ContainsFunc(gi.cis, func(ci *computeInstance) bool { return ci.id == cr.ID }):
		return errors.New("id used twice")
	case cr.ProfileID >= nvml.COMPUTE_INSTANCE_PROFILE_COUNT:
		return fmt.Errorf("profile_id %d out of range", cr.ProfileID)
	}
	p, r := gi.ciProfile(int(cr.ProfileID))
	switch {
	case r != nvml.SUCCESS:
		return fmt.Errorf("profile_id %d does not fit a %s instance", cr.ProfileID, gi.prof.name)
	case pl.Size != p.SliceCount || !slices.Contains(ciStarts(p.SliceCount, gi.prof.slice), pl.Start):
		return fmt.Errorf("placement %d+%d is not one of profile_id %d", pl.Start, pl.Size, cr.ProfileID)
	case !slices.Contains(gi.ciFreeStarts(p.SliceCount), pl.Start):
		return fmt.Errorf("placement %d+%d overlaps another compute instance", pl.Start, pl.Size)
	}
	ci := gi.addCI(cr.ID, p, pl.Start)
	if cr.UUID != ci.dev.uuid {
		return fmt.Errorf("uuid %q, but this instance's is %q", cr.UUID, ci.dev.uuid)
	}
	return nil
}

// gpuSnapshot is what change needs to undo a change to one GPU.
type gpuSnapshot struct {
	state gpuState
	cis   [][]*computeInstance // of state.gis, in order
}

// snapshot copies g deeply enough to undo any change the sim makes to it:
// the instance slices are cloned because appends, sorts and deletes reuse
// their arrays. Callers hold n.mu.
func (g *gpuState) snapshot() gpuSnapshot {
	s := gpuSnapshot{state: *g}
	s.state.gis = slices.Clone(g.gis)
	for _, gi := range g.gis {
		s.cis = append(s.cis, slices.Clone(gi.cis))
	}
	return s
}

// rollback undoes every change since s was taken. Instances created since
// were never handed out, but are marked destroyed all the same.
func (g *gpuState) rollback(s gpuSnapshot) {
	for _, gi := range g.gis {
		for _, ci := range gi.cis {
			ci.destroyed = true
		}
		gi.destroyed = true
	}
	*g = s.state
	for i, gi := range g.gis {
		gi.destroyed = false
		gi.cis = s.cis[i]
		for _, ci := range gi.cis {
			ci.destroyed = false
		}
	}
}

// change runs set, which changes g or fails without changing it, and then
// writes the state file; if that write fails the change is undone, so what
// callers saw succeed is what a restarted process finds. Callers hold n.mu.
func (n *Node) change(g *gpuState, set func() error) error {
	if n.store == nil {
		return set()
	}
	s := g.snapshot()
	if err := set(); err != nil {
		return err
	}
	if err := n.persist(); err != nil {
		g.rollback(s)
		return fmt.Errorf("sim gpu %d (%s): %w", g.index, g.uuid, err)
	}
	return nil
}

// mutate is change for the NVML calls that change kept state: f cannot
// fail, and a failed write is ERROR_UNKNOWN, logged with its cause.
func (n *Node) mutate(g *gpuState, call string, f func()) nvml.Return {
	// The change may change the load (MIG mode, instances): count what
	// the old one did first.
	g.advance(n)
	err := n.change(g, func() error { f(); return nil })
	if err != nil {
		n.opts.logger.Error("sim: NVML call failed: cannot save GPU state", "call", call, "gpu", g.index, "err", err)
		return nvml.ERROR_UNKNOWN
	}
	if n.opts.crashAfter > 0 {
		n.mutations++
		if n.mutations == n.opts.crashAfter {
			n.opts.logger.Warn("sim: crashing the process as asked", "after-changes", n.mutations, "last", call, "gpu", g.index)
			if n.opts.crash != nil {
				n.opts.crash()
			} else {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {} // the signal is on its way
			}
		}
	}
	return nvml.SUCCESS
}
