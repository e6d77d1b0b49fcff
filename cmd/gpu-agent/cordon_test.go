package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/gpu-agent/gpu-agent/kube"
)

// cordon and uncordon edit the Node's annotation step by step, as an admin
// would use them, and say what it lists.
func TestCordonCommand(t *testing.T) {
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}})
	ctx := context.Background()
	for _, tt := range []struct {
		add      bool
		gpus     []string
		want     string // the annotation; "" : none
		wantSays string
	}{
		{true, []string{"1"}, "1", "cordoned GPUs: 1"},
		{true, []string{"GPU-abc", "1"}, "1,GPU-abc", "cordoned GPUs: 1, GPU-abc"},
		{false, []string{"3"}, "1,GPU-abc", "not cordoned as written: 3"},
		{false, []string{"1"}, "GPU-abc", "cordoned GPUs: GPU-abc"},
		{true, []string{"0"}, "GPU-abc,0", "cordoned GPUs: GPU-abc, 0"},
		{false, nil, "", "no GPU cordoned"}, // --all
	} {
		var out bytes.Buffer
		if err := editCordon(ctx, client, "n1", tt.add, tt.gpus, &out); err != nil {
			t.Fatal(err)
		}
		n, err := client.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got, ok := n.Annotations[kube.CordonAnnotation]
		if got != tt.want || ok != (tt.want != "") || !strings.Contains(out.String(), tt.wantSays) {
			t.Fatalf("add=%v %v: annotation %q (present %v), said %q; want %q saying %q", tt.add, tt.gpus, got, ok, out.String(), tt.want, tt.wantSays)
		}
	}
}

// What cannot name a GPU is refused before the API is asked.
func TestCordonUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"cordon"}, "no GPU given"},
		{[]string{"uncordon"}, "no GPU given"},
		{[]string{"uncordon", "--all", "1"}, "--all or GPUs"},
		{[]string{"cordon", "MIG-1234"}, "MIG device"},
		{[]string{"cordon", "1,2"}, "neither a GPU index"},
		{[]string{"cordon", "-1"}, "flag provided but not defined"},
		{[]string{"cordon", "gpu0"}, "neither a GPU index"},
		{[]string{"cordon", "--all", "1"}, "flag provided but not defined: -all"},
	} {
		code, _, stderr := run(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 saying %q", tc.args, code, stderr, tc.want)
		}
	}
}
