package mig

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/stateformat"
)

// A journal as the agents before versioned journals wrote it (format 1.0,
// which names no version) is resumed as it always was.
func TestJournalReadsUnversioned(t *testing.T) {
	b, err := os.ReadFile("testdata/journal-1.0.json")
	if err != nil {
		t.Fatal(err)
	}
	const uuid = "GPU-b6c6830a-c929-5dc0-96d9-69131533358b"
	j, err := decodeJournal(b, uuid)
	if err != nil {
		t.Fatal(err)
	}
	if j.Next != 1 || len(j.Plan.Steps) != 2 || j.Plan.Steps[0].GI != 7 || j.Plan.Want.Counts["7g.40gb"] != 1 {
		t.Fatalf("read %+v", j)
	}
	// What this build writes of it is the same bytes: a rollback to an
	// agent from before versioned journals reads it.
	again, err := json.Marshal(j)
	if err != nil || !bytes.Equal(again, b) {
		t.Fatalf("written back as\n%s\nwant\n%s (%v)", again, b, err)
	}
}

// A journal of a newer minor format (a newer agent, rolled back mid-plan)
// is resumed without the fields that minor added; one of a newer major is
// not this build's to resume or to set aside: the GPU is left as it is,
// the journal in place for the build that wrote it, and the error says
// which file, its format and the formats this build reads.
func TestJournalNewerFormat(t *testing.T) {
	for _, tc := range []struct {
		name, version string
		// err is what the error says ("": resumed).
		err string
	}{
		{name: "newer minor", version: `"version":1,"minor":4,"resumeToken":{"a":1},`},
		{name: "newer major", version: `"version":2,`, err: "format 2.0, written by a newer gpu-agent; this build reads 1.0, and any newer 1.x"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, "dgx-a100", sim.WithMIGEnabled())
			plan, _, err := MakePlan(r.gpu(0), r.profiles(0), want("7x1g.5gb"), nil)
			if err != nil || len(plan.Steps) < 2 {
				t.Fatalf("plan %v, %v", plan.Steps, err)
			}
			path := filepath.Join(r.dir, "mig", plan.UUID+".json")
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				t.Fatal(err)
			}
			b, _ := json.Marshal(journal{Plan: plan, Next: 1})
			b = append([]byte("{"+tc.version), b[1:]...)
			if err := os.WriteFile(path, b, 0o644); err != nil {
				t.Fatal(err)
			}
			before := layout(r.gpu(0))
			st, err := r.ap.Apply(context.Background(), plan, nil)
			if tc.err == "" {
				if err != nil || st.Phase != PhaseApplied {
					t.Fatalf("Apply = %+v, %v; want the journal resumed", st, err)
				}
				if _, err := os.Stat(path + ".unreadable"); !errors.Is(err, os.ErrNotExist) {
					t.Fatalf("journal set aside: %v", err)
				}
				return
			}
			var newer *stateformat.NewerError
			if !errors.As(err, &newer) || st.Phase != PhaseFailed || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("Apply = %+v, %v; want a failure naming %s and saying %q", st, err, path, tc.err)
			}
			if got, _ := os.ReadFile(path); !bytes.Equal(got, b) {
				t.Fatalf("journal now\n%s\nwant it left as\n%s", got, b)
			}
			if after := layout(r.gpu(0)); strings.Join(after, ",") != strings.Join(before, ",") {
				t.Fatalf("GPU changed from %v to %v", before, after)
			}
		})
	}
}
