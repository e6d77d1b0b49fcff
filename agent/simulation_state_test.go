package agent

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/ledger"
)

// The simulation's operations on what surrounds the agent, from what
// attacks on it found: a state dir that fills and empties, the Node's
// cordon annotation, an upgrade to a newer build and a rollback from it
// (its state files rewritten as the newer build writes them), and an API
// server that loses its data. Each has invariants of its own, checked
// after every operation with the others (check).

// errFull is what a full state dir answers a write.
var errFull = syscall.ENOSPC

// writeState is atomicfile.Write into the seed's state dir: refused while
// it is full. The checkpoint, the MIG journals and the allocation log's
// rewrites go through it.
func (s *simRun) writeState(path string, data []byte, opts ...atomicfile.Options) error {
	if s.full {
		return fmt.Errorf("write %s: %w", path, errFull)
	}
	return atomicfile.Write(path, data, opts...)
}

// simLogFile is the allocation log opened for appending: a write while the
// state dir is full fails, sometimes after writing part of the record, as
// write(2) does when the disk fills mid-record.
type simLogFile struct {
	s *simRun
	*os.File
}

func (f simLogFile) Write(b []byte) (int, error) {
	if !f.s.full {
		return f.File.Write(b)
	}
	n := 0
	if f.s.rng.IntN(2) == 0 {
		n, _ = f.File.Write(b[:len(b)/2])
	}
	return n, &os.PathError{Op: "write", Path: f.Name(), Err: errFull}
}

// newLedger is the agent's ledger, its allocation log in the seed's state
// dir; an error (the state dir full at start) leaves it refusing Allocate
// until the log opens.
func (s *simRun) newLedger(log *slog.Logger) *ledger.Ledger {
	l, err := ledger.New(ledger.Options{StateDir: s.dir, Now: s.clock.Now, Logger: log, Write: s.writeState,
		OpenLog: func(path string) (ledger.LogFile, error) {
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				return nil, err
			}
			return simLogFile{s: s, File: f}, nil
		}})
	if err != nil {
		s.note("allocation log: %s", shortErr(err))
		s.seen["allocation log not open at start"]++
	}
	return l
}

// toggleFull fills the state dir, or frees space in it.
func (s *simRun) toggleFull() {
	if s.full {
		s.do("the state dir has room again", func() {
			s.full = false
			if s.rng.IntN(2) == 0 {
				s.h.step(Tick{})
			}
		})
		return
	}
	s.do("the state dir is full", func() {
		s.full = true
		s.seen["state dir full"]++
	})
}

// loggedNow checks that an allocation the ledger accepted is in the
// allocation log on disk: the restarted agent knows it only from there.
func (s *simRun) loggedNow(uuids []string) {
	b, err := os.ReadFile(filepath.Join(s.dir, ledger.AllocLogFile))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		s.tb.Fatal(err)
	}
	entries, _, err := ledger.DecodeAllocLog(b)
	if err != nil {
		s.tb.Fatal(err)
	}
	for _, u := range uuids {
		if _, ok := entries[u]; !ok {
			s.fail("state: Allocate accepted what the allocation log does not have", "%s (state dir full: %v)", short(u), s.full)
		}
	}
}

// preparedNow checks a claim the agent answered as prepared: it is in the
// checkpoint on disk (a restart must know it), and it was not given a
// cordoned GPU, unless the ledger held it before (the answer is the one
// given before the cordon).
func (s *simRun) preparedNow(c *simClaim, had bool) {
	cp, err := LoadCheckpoint(s.dir)
	if err != nil {
		s.tb.Fatal(err)
	}
	if cp == nil || !hasKey(cp.Claims, c.uid) {
		s.fail("state: Prepare answered what the checkpoint does not have", "%s (state dir full: %v)", c.name, s.full)
	}
	if had {
		return
	}
	for _, d := range c.held {
		if s.cordonView[d.id.gpu] {
			s.violate("cordon: prepared a cordoned GPU", fmt.Sprintf("%s got %s (%s), on cordoned GPU %d", c.name, short(d.uuid), d.id, d.id.gpu))
		}
	}
}

// editCordon changes the Node's cordon annotation: a GPU added (by UUID or
// by index, sometimes one the node does not have) or removed, or the
// annotation cleared.
func (s *simRun) editCordon() {
	next := slices.Clone(s.cordon)
	truth := s.truth()
	g := s.rng.IntN(len(truth.gpus))
	as := truth.gpus[g].uuid
	switch s.rng.IntN(6) {
	case 0:
		as = strconv.Itoa(g)
	case 1:
		as = []string{"GPU-00000000-not-on-this-node", "17"}[s.rng.IntN(2)]
	}
	what := "cordon " + short(as)
	switch {
	case len(next) > 0 && s.rng.IntN(5) == 0:
		next, what = nil, "cordon cleared"
	case len(next) > 0 && s.rng.IntN(2) == 0:
		i := s.rng.IntN(len(next))
		what = "uncordon " + short(next[i])
		next = slices.Delete(next, i, i+1)
	case slices.Contains(next, as):
		s.do("cordon: "+short(as)+" is cordoned already", func() {})
		return
	default:
		next = append(next, as)
	}
	s.do(what, func() {
		s.cordon = next
		s.h.step(CordonChanged{GPUs: slices.Clone(next)})
		s.cordonView = s.cordonOf(next)
		s.seen["cordon changed"]++
	})
}

// cordonOf is the GPUs (by index) a cordon list names, as the agent reads
// it: UUIDs, or NVML indexes in decimal.
func (s *simRun) cordonOf(list []string) map[int]bool {
	truth := s.truth()
	out := map[int]bool{}
	for _, as := range list {
		if i := truth.index(as); i >= 0 {
			out[i] = true
		} else if n, err := strconv.Atoi(as); err == nil && strconv.Itoa(n) == as && n >= 0 && n < len(truth.gpus) {
			out[n] = true
		}
	}
	return out
}

// cordonHeld (invariant 6): nothing on a cordoned GPU is offered to new
// work: unhealthy to the kubelet, tainted in the pool.
func (s *simRun) cordonHeld(_ *simTruth, _ []holder, report reporter) {
	if len(s.cordonView) == 0 {
		return
	}
	cat := s.pub.last()
	for _, name := range slices.Sorted(maps.Keys(cat.Resources)) {
		for _, d := range cat.Resources[name].Devices {
			if d.Healthy && s.cordonView[d.GPU] {
				if !report("cordon: the device plugin offers a cordoned GPU", fmt.Sprintf("%s offers %s healthy, on cordoned GPU %d", name, short(d.ID), d.GPU)) {
					return
				}
			}
		}
	}
	pool := s.rec.last()
	if pool == nil {
		return
	}
	for _, d := range pool.Devices {
		g := d.ParentIndexOrSelf()
		if s.cordonView[g] && d.Cordoned == "" {
			if !report("cordon: the pool offers a cordoned GPU untainted", fmt.Sprintf("%s, on cordoned GPU %d", d.Name, g)) {
				return
			}
		}
	}
}

// stateSaved (invariant 7): what the agent tells its claim-status writer
// is the claims it holds, and while /status says the state is saved, the
// checkpoint on disk has every claim the ledger holds and the cordon the
// agent acts on.
func (s *simRun) stateSaved(_ *simTruth, _ []holder, report reporter) {
	claims := s.h.a.ledger.Claims()
	if got := s.statuses.last; got != nil || len(claims) > 0 {
		if want := slices.Sorted(maps.Keys(claims)); !slices.Equal(slices.Sorted(maps.Keys(got)), want) {
			if !report("claim status: not the claims the ledger holds", fmt.Sprintf("statuses of %v, ledger %v", slices.Sorted(maps.Keys(got)), want)) {
				return
			}
		}
	}
	st := s.h.a.Status().State
	if st == nil || st.Error != "" {
		return
	}
	cp, err := LoadCheckpoint(s.dir)
	if err != nil {
		s.tb.Fatal(err)
	}
	if cp == nil {
		cp = &Checkpoint{}
	}
	for _, uid := range slices.Sorted(maps.Keys(claims)) {
		if !hasKey(cp.Claims, uid) {
			if !report("state: saved, without a claim the ledger holds", fmt.Sprintf("%s is not in the checkpoint", claims[uid].Name)) {
				return
			}
		}
	}
	if !slices.Equal(cp.Cordon, s.h.a.cordoned) {
		report("state: saved, without the cordon in force", fmt.Sprintf("checkpoint %v, agent %v", cp.Cordon, s.h.a.cordoned))
	}
}

// simClaimStatus is the claim-status writer: what the agent last asked it
// to write.
type simClaimStatus struct{ last map[types.UID]dra.ClaimStatus }

// Set implements ClaimStatusPublisher.
func (c *simClaimStatus) Set(claims map[types.UID]dra.ClaimStatus) { c.last = maps.Clone(claims) }

// upgradeRollback runs a newer build on the node and rolls back to this
// one: the agent is killed; the newer build (a newer minor of every state
// format) ran and rewrote the state files as it writes them, the version
// named and a field this build does not know in each; this build starts on
// them. It must keep everything they hold: the claims, intents and
// releases, the allocations, the cordon, the MIG plans in flight.
func (s *simRun) upgradeRollback() {
	s.do("agent upgraded to a newer minor, then rolled back", func() {
		s.close()
		before, err := LoadCheckpoint(s.dir)
		if err != nil {
			s.tb.Fatal(err)
		}
		if before == nil {
			before = &Checkpoint{}
		}
		logged := s.allocLog()
		aside := s.setAside()
		n := s.asNewerMinor()
		s.note("state files rewritten as the newer build writes them: %d", n)
		s.seen["state files of a newer minor read"]++
		s.boot(func() {
			l := s.h.a.ledger
			lost := func(what string, had []types.UID, has map[types.UID]PreparedClaim) {
				for _, uid := range had {
					if !hasKey(has, uid) {
						s.fail("upgrade: rolled back, lost what the newer build kept", "%s %s", what, uid)
					}
				}
			}
			lost("claim", slices.Sorted(maps.Keys(before.Claims)), l.Claims())
			lost("intent", slices.Sorted(maps.Keys(before.Intents)), l.Intents())
			lost("release", slices.Sorted(maps.Keys(before.Releasing)), l.Releases())
			for _, u := range slices.Sorted(maps.Keys(logged)) {
				if _, ok := l.Allocations()[u]; !ok {
					s.fail("upgrade: rolled back, lost what the newer build kept", "allocation of %s", short(u))
				}
			}
			if !slices.Equal(s.h.a.cordoned, before.Cordon) {
				s.fail("upgrade: rolled back, lost what the newer build kept", "cordon %v, the checkpoint had %v", s.h.a.cordoned, before.Cordon)
			}
			s.newlyAside(aside)
		})
		// The MIG journals are read when their plans resume: one set
		// aside then is a plan forgotten half done.
		s.newlyAside(aside)
	})
}

// allocLog is what the allocation log on disk holds.
func (s *simRun) allocLog() map[string]ledger.AllocEntry {
	b, err := os.ReadFile(filepath.Join(s.dir, ledger.AllocLogFile))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		s.tb.Fatal(err)
	}
	entries, _, err := ledger.DecodeAllocLog(b)
	if err != nil {
		s.tb.Fatal(err)
	}
	return entries
}

// journals are the MIG journals in the state dir.
func (s *simRun) journals() []string {
	js, err := filepath.Glob(filepath.Join(s.dir, "mig", "*.json"))
	if err != nil {
		s.tb.Fatal(err)
	}
	return js
}

// setAside are the state files set aside as unreadable.
func (s *simRun) setAside() []string {
	var out []string
	for _, pattern := range []string{"*.unreadable*", filepath.Join("mig", "*.unreadable*")} {
		ms, err := filepath.Glob(filepath.Join(s.dir, pattern))
		if err != nil {
			s.tb.Fatal(err)
		}
		for _, m := range ms {
			rel, _ := filepath.Rel(s.dir, m)
			out = append(out, rel)
		}
	}
	return out
}

// newlyAside fails the seed if a state file was set aside since was.
func (s *simRun) newlyAside(was []string) {
	for _, name := range s.setAside() {
		if !slices.Contains(was, name) {
			s.fail("upgrade: rolled back, a newer minor's file set aside", "%s", name)
		}
	}
}

// newerFields is what the newer build adds to each object it writes: the
// minor it writes, and a field this build does not know.
const newerFields = `"minor":7,"fromNewer":{"x":[1]},`

// checkpointMinor is the minor a checkpoint names, as written.
var checkpointMinor = regexp.MustCompile(`"minor":\s*\d+,\s*`)

// asNewerMinor rewrites the state files as the newer build writes them:
// the checkpoint, every record of the allocation log and every MIG journal
// name a newer minor of their major and carry a field this build does not
// know. It returns how many files it rewrote.
func (s *simRun) asNewerMinor() int {
	n := 0
	rewrite := func(path string, edit func([]byte) []byte) {
		b, err := os.ReadFile(path)
		if errors.Is(err, os.ErrNotExist) {
			return
		}
		if err != nil {
			s.tb.Fatal(err)
		}
		if err := os.WriteFile(path, edit(b), 0o600); err != nil {
			s.tb.Fatal(err)
		}
		n++
	}
	// The checkpoint names its major already; the journal and the log's
	// records name theirs only from 1.1 on.
	rewrite(filepath.Join(s.dir, CheckpointFile), func(b []byte) []byte {
		b = checkpointMinor.ReplaceAll(b, nil) // the newer build writes its own
		return append([]byte("{"+newerFields), bytes.TrimPrefix(bytes.TrimLeft(b, " \n"), []byte("{"))...)
	})
	rewrite(filepath.Join(s.dir, ledger.AllocLogFile), func(b []byte) []byte {
		return bytes.ReplaceAll(b, []byte(`{"at"`), []byte(`{"version":1,`+newerFields+`"at"`))
	})
	for _, j := range s.journals() {
		rewrite(j, func(b []byte) []byte {
			return append([]byte(`{"version":1,`+newerFields), bytes.TrimPrefix(b, []byte("{"))...)
		})
	}
	return n
}

// apiServerLost is the API server losing its data (an etcd restored from
// an old backup, or wiped): some of the node's ResourceClaims are gone, so
// the scheduler no longer counts the devices they were allocated, while
// the kubelet still runs their pods and will unprepare them; and the
// node's ResourceSlices are gone until the slice controller writes them
// again (at the next resync here).
func (s *simRun) apiServerLost() {
	var lost []string
	for _, c := range append(slices.Clone(s.kube.claims), s.kube.unpreparing...) {
		if !c.forgotten && s.rng.IntN(2) == 0 {
			lost = append(lost, c.name)
		}
	}
	slices.Sort(lost)
	what := "the API server lost the ResourceSlices"
	if len(lost) > 0 {
		what += " and claims " + strings.Join(lost, ", ")
	}
	s.do(what, func() {
		for _, c := range append(slices.Clone(s.kube.claims), s.kube.unpreparing...) {
			if slices.Contains(lost, c.name) {
				c.forgotten = true
			}
		}
		s.kube.noSlices = true
		s.seen["API server lost its data"]++
	})
}
