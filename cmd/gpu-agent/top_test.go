package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/podresources"
	"github.com/gpu-agent/gpu-agent/telemetry"
	procusage "github.com/gpu-agent/gpu-agent/usage"
)

type topPods struct{ x *procusage.PodIndex }

func (p topPods) PodIndex() *procusage.PodIndex { return p.x }

type topAttr struct{ a *podresources.Attribution }

func (t topAttr) Attribution() *podresources.Attribution { return t.a }

// TestTop: processes started over the sim's HTTP API with their pods'
// cgroups show in `gpu-agent top` under their pods, through /holders: the
// busy one with its SM %, the one that does nothing idle.
func TestTop(t *testing.T) {
	now := time.Date(2026, 5, 6, 7, 8, 9, 0, time.UTC)
	clock := func() time.Time { return now }
	n, err := sim.New("dgx-h100", sim.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	if r := n.Init(); r != nvml.SUCCESS {
		t.Fatal(r)
	}
	t.Cleanup(func() { n.Shutdown() })
	inv, err := gpu.New(n, gpu.Options{})
	if err != nil {
		t.Fatal(err)
	}
	g := inv.GPUs[3].UUID
	var pods []*corev1.Pod
	var held []*podresourcesv1.PodResources
	for i, name := range []string{"trainer", "notebook"} {
		uid, ctr := fmt.Sprintf("%08x-0000-4000-8000-000000000000", i+1), strings.Repeat(fmt.Sprint(i+1), 64)
		pods = append(pods, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ml", Name: name, UID: types.UID(uid)},
			Status: corev1.PodStatus{ContainerStatuses: []corev1.ContainerStatus{{Name: "main", ContainerID: "containerd://" + ctr}}}})
		held = append(held, &podresourcesv1.PodResources{Namespace: "ml", Name: name, Containers: []*podresourcesv1.ContainerResources{{
			Name: "main", Devices: []*podresourcesv1.ContainerDevices{{ResourceName: "nvidia.com/gpu.shared", DeviceIds: []string{fmt.Sprintf("%s::%d", g, i)}}}}}})
		body := fmt.Sprintf(`{"gpu": 3, "pid": %d, "mem_used_bytes": %d, "sm_util": %d, "cgroup": "0::/kubepods/besteffort/pod%s/%s\n"}`,
			4000+i, (i+1)<<30, 45*(1-i), uid, ctr)
		rec := httptest.NewRecorder()
		n.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/sim/process", strings.NewReader(body)))
		if rec.Code != http.StatusOK {
			t.Fatalf("/sim/process: %d %s", rec.Code, rec.Body)
		}
	}
	tr := telemetry.NewHolderTracker(n, telemetry.HolderOptions{Owners: procusage.SimResolver{Src: n}, Pods: topPods{procusage.NewPodIndex(pods)},
		Attribution: topAttr{podresources.NewAttribution(held, nil)}, Now: clock})
	tr.SetInventory(inv)
	for range 19 {
		now = now.Add(10 * time.Second)
		tr.Pass()
	}
	srv := httptest.NewServer(withHolders(http.NotFoundHandler(), tr))
	defer srv.Close()

	var out bytes.Buffer
	if err := cmdTop(context.Background(), []string{"--addr", srv.URL}, &out, &out); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(out.String(), "\n")
	if !strings.HasPrefix(lines[0], "NAMESPACE") {
		t.Fatalf("no header:\n%s", out.String())
	}
	want := map[string][]string{
		"trainer":  {"1/2", " 45 ", "1.0 GiB", "active"},
		"notebook": {"1/2", " 0 ", "2.0 GiB", "3m0s"},
	}
	for pod, parts := range want {
		line := ""
		for _, l := range lines {
			if strings.Contains(l, " "+pod+" ") {
				line = l
			}
		}
		for _, p := range parts {
			if !strings.Contains(line, p) {
				t.Errorf("%s: %q lacks %q\n%s", pod, line, p, out.String())
			}
		}
	}
	out.Reset()
	if err := cmdTop(context.Background(), []string{"--addr", srv.URL, "--idle-only"}, &out, &out); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out.String(), "trainer") || !strings.Contains(out.String(), "notebook") {
		t.Errorf("--idle-only:\n%s", out.String())
	}

	// An agent without /holders is told apart from a broken one.
	old := httptest.NewServer(http.NotFoundHandler())
	defer old.Close()
	if err := cmdTop(context.Background(), []string{"--addr", old.URL}, &out, &out); err == nil || !strings.Contains(err.Error(), "older than gpu-agent top") {
		t.Errorf("an agent without /holders: %v", err)
	}

	// gpu-agent status ends with the same holders, in fewer columns.
	status, err := os.ReadFile(filepath.Join("testdata", "status", "standalone-xid.json"))
	if err != nil {
		t.Fatal(err)
	}
	serveStatus := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/status" {
			http.NotFound(w, r)
			return
		}
		w.Write(status)
	})
	withStatus := httptest.NewServer(withHolders(serveStatus, tr))
	defer withStatus.Close()
	out.Reset()
	if err := cmdStatus(context.Background(), []string{"--addr", withStatus.URL}, &out, &out); err != nil {
		t.Fatal(err)
	}
	statusLines := collapsed(out.String())
	for _, w := range []string{
		"Holders: 2, 1 idle for a minute or more (sampled 2026-05-06T07:11:19Z; gpu-agent top for more)",
		"HOLDER GPU DEVICE SHARE SM% MEMORY IDLE FOR",
		"ml/trainer/main 3 whole 1/2 45 1.0 GiB active",
		"ml/notebook/main 3 whole 1/2 0 2.0 GiB 3m0s",
	} {
		if !slices.Contains(statusLines, w) {
			t.Errorf("status: no line %q in:\n%s", w, out.String())
		}
	}
	// An agent without /holders still has its status shown, and says so.
	withoutHolders := httptest.NewServer(serveStatus)
	defer withoutHolders.Close()
	out.Reset()
	if err := cmdStatus(context.Background(), []string{"--addr", withoutHolders.URL}, &out, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "Node:") || !strings.Contains(out.String(), "Holders: not known:") || strings.Contains(out.String(), "HOLDER ") {
		t.Errorf("status of an agent without /holders:\n%s", out.String())
	}
}

// collapsed is s's lines, trimmed, with each run of spaces made one.
func collapsed(s string) []string {
	spaces := regexp.MustCompile(`\s+`)
	var lines []string
	for _, l := range strings.Split(s, "\n") {
		lines = append(lines, strings.TrimSpace(spaces.ReplaceAllString(l, " ")))
	}
	return lines
}

// TestTopMPS: where a holder is an MPS client, top shows its active-thread
// limit and its SM % as a part of it, and status the same in one column;
// "-" for a holder that is no client, or whose SM % is not known. Without
// MPS clients neither has the columns.
func TestTopMPS(t *testing.T) {
	body, err := os.ReadFile(filepath.Join("testdata", "holders", "mps.json"))
	if err != nil {
		t.Fatal(err)
	}
	var snap telemetry.HolderSnapshot
	if err := json.Unmarshal(body, &snap); err != nil {
		t.Fatal(err)
	}
	noMPS := telemetry.HolderSnapshot{Time: snap.Time, Holders: snap.Holders[3:]}
	for _, tc := range []struct {
		name   string
		snap   *telemetry.HolderSnapshot
		write  func(io.Writer, *telemetry.HolderSnapshot) error
		want   []string
		absent []string
	}{
		{
			name:  "top",
			snap:  &snap,
			write: func(w io.Writer, s *telemetry.HolderSnapshot) error { return writeTop(w, s, false) },
			want: []string{
				"NAMESPACE POD CONTAINER CLAIM GPU DEVICE SHARE SM% SM% 1H SM% 24H MEMORY PROCS IDLE FOR MPS LIMIT USED OF LIMIT",
				"ml mps-a main mps-a 0 whole 1/2 25 - - 2.0 GiB 1 active 50% 50%",
				"ml mps-b main - 0 whole 1/2 60 - - 4.0 GiB 1 active 25% 240%",
				"ml mps-new main - 0 whole 1/2 - - - 0 B 0 - 25% -",
				"ml alone main - 1 whole alone 70 - - 1.0 GiB 1 active - -",
			},
		},
		{
			name:   "top without MPS clients",
			snap:   &noMPS,
			write:  func(w io.Writer, s *telemetry.HolderSnapshot) error { return writeTop(w, s, false) },
			want:   []string{"ml alone main - 1 whole alone 70 - - 1.0 GiB 1 active"},
			absent: []string{"MPS"},
		},
		{
			name:  "status",
			snap:  &snap,
			write: func(w io.Writer, s *telemetry.HolderSnapshot) error { return writeStatusHolders(w, s, nil) },
			want: []string{
				"HOLDER GPU DEVICE SHARE SM% MEMORY IDLE FOR MPS USED OF LIMIT",
				"ml/mps-a/main (claim mps-a) 0 whole 1/2 25 2.0 GiB active 50% of 50%",
				"ml/mps-b/main 0 whole 1/2 60 4.0 GiB active 240% of 25%",
				"ml/mps-new/main 0 whole 1/2 - 0 B - - of 25%",
				"ml/alone/main 1 whole alone 70 1.0 GiB active -",
			},
		},
		{
			name:   "status without MPS clients",
			snap:   &noMPS,
			write:  func(w io.Writer, s *telemetry.HolderSnapshot) error { return writeStatusHolders(w, s, nil) },
			want:   []string{"ml/alone/main 1 whole alone 70 1.0 GiB active"},
			absent: []string{"MPS"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			if err := tc.write(&out, tc.snap); err != nil {
				t.Fatal(err)
			}
			lines := collapsed(out.String())
			for _, w := range tc.want {
				if !slices.Contains(lines, w) {
					t.Errorf("no line %q in:\n%s", w, out.String())
				}
			}
			for _, a := range tc.absent {
				if strings.Contains(out.String(), a) {
					t.Errorf("%q in:\n%s", a, out.String())
				}
			}
		})
	}
}
