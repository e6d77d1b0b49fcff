package mig

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// A journal is read back from disk, so it is outside input: whatever it
// holds, Apply must neither panic nor trust it, but set it aside with a
// warning and plan from what NVML shows (issue 23, defect 3: "next": -1
// panicked on every start).
func TestUntrustedJournalSetAside(t *testing.T) {
	for _, tc := range []struct {
		name string
		// journal rewrites the valid journal of a plan for gpu 0 (nil: a FIFO).
		journal func(j map[string]any)
		why     string
	}{
		{"next -1", func(j map[string]any) { j["next"] = -1 }, "next step -1"},
		{"next past the end", func(j map[string]any) { j["next"] = 99 }, "next step 99"},
		{"another GPU's plan", func(j map[string]any) { j["plan"].(map[string]any)["uuid"] = "GPU-other" }, "plan for GPU \\\"GPU-other\\\""},
		{"unknown op", func(j map[string]any) {
			j["plan"].(map[string]any)["steps"].([]any)[0].(map[string]any)["op"] = "format"
		}, "unknown op \\\"format\\\""},
		{"profile index out of range", func(j map[string]any) {
			j["plan"].(map[string]any)["steps"].([]any)[0].(map[string]any)["profileIndex"] = -5
		}, "profile index -5"},
		{"a named pipe", nil, "named pipe"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
			r.ap = NewApplier(r.node, r.dir, slog.New(slog.NewTextHandler(&logs, nil)))
			target := want("7x1g.5gb")
			plan, _, err := MakePlan(r.gpu(0), r.profiles(0), target, nil)
			if err != nil || len(plan.Steps) == 0 {
				t.Fatalf("plan %v, %v", plan.Steps, err)
			}
			path := filepath.Join(r.dir, "mig", plan.UUID+".json")
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				t.Fatal(err)
			}
			if tc.journal == nil {
				if err := syscall.Mkfifo(path, 0o644); err != nil {
					t.Fatal(err)
				}
			} else {
				var j map[string]any
				b, _ := json.Marshal(journal{Plan: plan, Next: 1})
				if err := json.Unmarshal(b, &j); err != nil {
					t.Fatal(err)
				}
				tc.journal(j)
				b, _ = json.Marshal(j)
				if err := os.WriteFile(path, b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			st, err := r.ap.Apply(context.Background(), plan, nil)
			if err != nil || st.Phase != PhaseApplied {
				t.Fatalf("Apply = %+v, %v; want the plan applied from NVML", st, err)
			}
			if got := counts(r.gpu(0)); got["1g.5gb"] != 7 {
				t.Fatalf("layout %v, want 7 1g.5gb", got)
			}
			if !strings.Contains(logs.String(), "MIG journal not trusted") || !strings.Contains(logs.String(), tc.why) {
				t.Fatalf("log does not say why the journal was set aside (%q):\n%s", tc.why, logs.String())
			}
			if _, err := os.Lstat(path + ".unreadable"); err != nil {
				t.Fatalf("journal not set aside: %v", err)
			}
		})
	}
}

// A journal's bytes are outside input: decodeJournal refuses them or gives
// a journal Apply can resume (Next within the plan, every step one a
// planner could make), and Apply resumes it on a simulated GPU without
// panicking, whatever NVML then says.
func FuzzJournal(f *testing.F) {
	const uuid = "GPU-b6c6830a-c929-5dc0-96d9-69131533358b" // GPU 0 of sim:dgx-a100
	for _, s := range []string{
		`{"plan":{"gpu":0,"uuid":"` + uuid + `","want":{"migEnabled":true,"counts":{"1g.5gb":7}},"steps":[{"op":"create","profile":"1g.5gb","profileIndex":0,"placement":{"start":0,"size":1},"reason":"x"}]},"next":0}`,
		`{"plan":{"gpu":0,"uuid":"` + uuid + `","want":{"migEnabled":true,"counts":{"7g.40gb":1}},"steps":[{"op":"destroy","profile":"1g.5gb","profileIndex":0,"placement":{"start":0,"size":1},"gi":1,"reason":"x"},{"op":"create","profile":"7g.40gb","profileIndex":4,"placement":{"start":0,"size":8},"reason":"x"}]},"next":1}`,
		`{"plan":{"gpu":0,"uuid":"` + uuid + `","want":{"migEnabled":false},"steps":[{"op":"set-mig-mode","placement":{"start":0,"size":0},"reason":"x"}]},"next":-1}`,
		`{"plan":{"gpu":0,"uuid":"GPU-other","steps":[]},"next":0}`,
		`{"version":1,"minor":3,"plan":{"gpu":0,"uuid":"` + uuid + `","want":{"migEnabled":true},"steps":[],"later":1},"next":0}`,
		`{"version":2,"plan":{"gpu":0,"uuid":"` + uuid + `"},"next":0}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		j, err := decodeJournal(b, uuid)
		if err != nil {
			return
		}
		if j.Next < 0 || j.Next > len(j.Plan.Steps) || j.Plan.UUID != uuid {
			t.Fatalf("accepted a journal Apply cannot resume: next %d of %d, uuid %q", j.Next, len(j.Plan.Steps), j.Plan.UUID)
		}
		n, err := sim.New("dgx-a100", sim.WithMIGEnabled())
		if err != nil {
			t.Fatal(err)
		}
		n.Init()
		defer n.Shutdown()
		dir := t.TempDir()
		ap := NewApplier(n, dir, slog.New(slog.DiscardHandler))
		if err := os.MkdirAll(filepath.Join(dir, "mig"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(ap.path(uuid), b, 0o644); err != nil {
			t.Fatal(err)
		}
		plan := j.Plan
		plan.GPU = 0
		ap.Apply(context.Background(), plan, nil) // errors are NVML's to give; a panic is ours
	})
}
