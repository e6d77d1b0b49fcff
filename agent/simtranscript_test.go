package agent

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/catalog"
)

// A seed's transcript: each operation as the sequence has it, then, after
// "----", what it left (the state sections that changed since the operation
// before), in the spirit of etcd raft's datadriven test files, so that a
// person can follow a failing seed step by step:
//
//	go test -run '^TestSimulation$' ./agent -sim.seed=K -sim.steps=N -sim.transcript=FILE
//	make sim-transcript SEED=K SIM_STEPS=N          # into sim-K.txt
//
// (go test runs in the package's directory: a relative FILE is agent/FILE.)
// The sections: what NVML has (each GPU's MIG mode and MIG devices, GPU
// instances without a compute instance), what the kubelet was last offered
// (the catalog, each device after its GPU's index: healthy devices, and
// unhealthy ones with why) and the
// scheduler (the DRA pool), who holds what as the kubelet knows it
// (containers, prepared claims, claims being unprepared), and the agent's
// ledger (claims, intents, releases, doomed devices).
var simTranscript = flag.String("sim.transcript", "", "TestSimulation: write the transcript of the seed run (with several, of the first that fails) to this file")

// transcript is a seed's transcript as it is written.
type transcript struct {
	b strings.Builder
	// done is how many lines of simRun.ops are in it; last the sections
	// last written, by title.
	done int
	last map[string]string
}

// record adds the operations since the last record and what they left.
func (s *simRun) record() {
	t := s.transcript
	if t == nil || t.done == len(s.ops) {
		return
	}
	for _, l := range s.ops[t.done:] {
		t.b.WriteString(l + "\n")
	}
	t.done = len(s.ops)
	t.b.WriteString("----\n")
	changed := 0
	for _, sec := range s.sections() {
		if t.last[sec.title] == sec.body {
			continue
		}
		t.last[sec.title] = sec.body
		changed++
		t.b.WriteString(sec.title + ":\n" + sec.body)
	}
	if changed == 0 {
		t.b.WriteString("(nothing changed)\n")
	}
	t.b.WriteString("\n")
}

// finish records what is left and how the seed ended.
func (s *simRun) finish(v simViolation) string {
	t := s.transcript
	if t == nil {
		return ""
	}
	func() {
		defer func() {
			if r := recover(); r != nil { // the state cannot be read: the ops still can
				t.b.WriteString(fmt.Sprintf("(state unreadable: %v)\n", r))
			}
		}()
		s.record()
	}()
	if v.kind != "" {
		t.b.WriteString("VIOLATION " + v.String() + "\n")
	} else {
		t.b.WriteString("(no violation)\n")
	}
	return t.b.String()
}

type section struct{ title, body string }

// sections is the state after an operation, as the transcript shows it.
func (s *simRun) sections() []section {
	if s.h == nil || s.node == nil {
		return nil
	}
	truth := s.truth()
	var out []section
	add := func(title string, lines []string) {
		if len(lines) == 0 {
			lines = []string{"(none)"}
		}
		out = append(out, section{title, "  " + strings.Join(lines, "\n  ") + "\n"})
	}

	// NVML.
	var gpus []string
	for i, g := range truth.gpus {
		var mig []string
		for _, u := range slices.Sorted(maps.Keys(truth.mig)) {
			if id := truth.mig[u]; id.gpu == i {
				mig = append(mig, fmt.Sprintf("%s@%d %s", id.profile, id.start, short(u)))
			}
		}
		slices.Sort(mig)
		for _, b := range g.bare {
			mig = append(mig, fmt.Sprintf("%s@%d without a compute instance", b.profile, b.start))
		}
		line := fmt.Sprintf("GPU %d %s", i, short(g.uuid))
		switch {
		case g.lost:
			line += " lost"
		case g.migOn:
			line += " MIG on: " + strings.Join(mig, ", ")
			if len(mig) == 0 {
				line += "no MIG device"
			}
		default:
			line += " MIG off"
		}
		if s.xid[i] {
			line += " (XID 48)"
		}
		gpus = append(gpus, line)
	}
	add("NVML", gpus)

	// The kubelet's catalog.
	var offered []string
	cat := s.pub.last()
	for _, name := range slices.Sorted(maps.Keys(cat.Resources)) {
		var healthy []string
		unhealthy := map[string][]string{} // why → devices
		devs := slices.Clone(cat.Resources[name].Devices)
		slices.SortStableFunc(devs, func(a, b catalog.Device) int { return cmp.Compare(a.GPU, b.GPU) })
		for _, d := range devs {
			// GPU index: device ID.
			if d.Healthy {
				healthy = append(healthy, fmt.Sprintf("%d:%s", d.GPU, short(d.ID)))
			} else {
				unhealthy[d.Reason] = append(unhealthy[d.Reason], fmt.Sprintf("%d:%s", d.GPU, short(d.ID)))
			}
		}
		line := name + ": " + strings.Join(healthy, " ")
		if len(healthy) == 0 {
			line += "nothing healthy"
		}
		offered = append(offered, line)
		for _, why := range slices.Sorted(maps.Keys(unhealthy)) {
			offered = append(offered, fmt.Sprintf("  unhealthy (%s): %s", shortErr(errors.New(why)), strings.Join(unhealthy[why], " ")))
		}
	}
	add("device plugin offers", offered)

	// The scheduler's pool: devices by name, partitions counted per GPU.
	var pool []string
	if p := s.rec.last(); p != nil {
		var devs []string
		unhealthy := map[string][]string{} // why → devices
		parts := map[int]int{}
		for _, d := range p.Devices {
			switch {
			case d.Partition:
				parts[d.ParentIndexOrSelf()]++
			case d.Unhealthy != "":
				unhealthy[d.Unhealthy] = append(unhealthy[d.Unhealthy], d.Name)
			default:
				devs = append(devs, d.Name)
			}
		}
		if len(devs) > 0 {
			pool = append(pool, strings.Join(devs, " "))
		}
		for _, why := range slices.Sorted(maps.Keys(unhealthy)) {
			pool = append(pool, fmt.Sprintf("unhealthy (%s): %s", shortErr(errors.New(why)), strings.Join(unhealthy[why], " ")))
		}
		var ps []string
		for _, g := range slices.Sorted(maps.Keys(parts)) {
			ps = append(ps, fmt.Sprintf("GPU %d: %d", g, parts[g]))
		}
		if len(ps) > 0 {
			pool = append(pool, "partitions "+strings.Join(ps, ", "))
		}
	}
	add("DRA pool offers", pool)

	// Who holds what, as the kubelet knows it.
	var held []string
	for _, c := range s.kube.containers {
		held = append(held, fmt.Sprintf("%s (%s): %s", c.name, c.resource, shortIDs(c.ids)))
	}
	for _, c := range s.kube.claims {
		if c.prepared {
			var ds []string
			for _, d := range c.held {
				ds = append(ds, fmt.Sprintf("%s (%s)", short(d.uuid), d.id))
			}
			held = append(held, fmt.Sprintf("%s: %s", c.name, strings.Join(ds, ", ")))
		} else {
			held = append(held, c.name+": not prepared")
		}
	}
	for _, c := range s.kube.unpreparing {
		held = append(held, c.name+": being unprepared")
	}
	add("held", held)

	// The agent's ledger.
	l := s.h.a.ledger
	var ledger []string
	for _, set := range []struct {
		what string
		m    map[types.UID]PreparedClaim
	}{{"claim", l.Claims()}, {"intent", l.Intents()}, {"release", l.Releases()}} {
		for _, uid := range slices.Sorted(maps.Keys(set.m)) {
			pc := set.m[uid]
			var ds []string
			for _, d := range pc.Devices {
				ds = append(ds, describeDevice(d))
			}
			ledger = append(ledger, fmt.Sprintf("%s %s: %s", set.what, pc.Name, strings.Join(ds, ", ")))
		}
	}
	doomed := l.Doomed()
	for _, u := range slices.Sorted(maps.Keys(doomed)) {
		ledger = append(ledger, fmt.Sprintf("doomed %s: %.80s", short(u), doomed[u]))
	}
	add("ledger", ledger)
	return out
}

// describeDevice is a claim's device in the ledger, for the transcript.
func describeDevice(d PreparedClaimDevice) string {
	out := d.Device
	if d.UUID != "" {
		out += " " + short(d.UUID)
	}
	if d.Created {
		out += fmt.Sprintf(" (made: %s@%d on %s)", d.Profile, d.Placement.Start, short(d.Parent))
	}
	if d.Shares > 0 {
		out += fmt.Sprintf(" (%d shares)", d.Shares)
	}
	return out
}

// A transcript has every operation of the sequence, in order, each
// followed by what it left; a claim prepared shows among the holders.
func TestSimulationTranscript(t *testing.T) {
	r := runSimulation(t, t.TempDir(), 3, 20, false, true)
	if r.violation.kind != "" {
		t.Fatalf("seed 3: %s", r.violation)
	}
	lines := strings.Split(r.transcript, "\n")
	at := 0
	for _, op := range r.ops {
		i := slices.Index(lines[at:], op)
		if i < 0 {
			t.Fatalf("the transcript lacks %q (or has it out of order):\n%s", op, r.transcript)
		}
		at += i + 1
		if !strings.HasPrefix(op, " ") && !slices.Contains(lines[at:], "----") {
			t.Fatalf("nothing after %q says what it left:\n%s", op, r.transcript)
		}
	}
	for _, want := range []string{"NVML:", "device plugin offers:", "held:", "ledger:"} {
		if !slices.Contains(lines, want) {
			t.Errorf("the transcript has no section %q:\n%s", want, r.transcript)
		}
	}
	for i, l := range lines {
		uuid, ok := strings.CutPrefix(l, "  prepared: ")
		if !ok {
			continue
		}
		uuid, _, _ = strings.Cut(uuid, " ")
		end := i + slices.Index(lines[i:], "")
		if !strings.Contains(strings.Join(lines[i:end], "\n"), "held:\n") || !strings.Contains(strings.Join(lines[i:end], "\n"), uuid+" (") {
			t.Errorf("after %q the transcript does not show %s held:\n%s", l, uuid, strings.Join(lines[i:end], "\n"))
		}
	}
	if !strings.HasSuffix(r.transcript, "(no violation)\n") {
		t.Errorf("the transcript does not end saying how the seed ended:\n%s", r.transcript)
	}
}
