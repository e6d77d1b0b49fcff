package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// CordonAnnotation lists, comma-separated, the GPUs of the Node (UUIDs or
// NVML indices) an admin took out of service: the agent offers them to no
// new work, and those who hold them keep them. The agent only reads it;
// `gpu-agent cordon` and `uncordon` write it.
const CordonAnnotation = "gpu-agent.io/cordon"

// SplitCordon is the annotation's GPUs, in order, without blanks or
// repeats. It is outside input (anyone who may annotate the Node writes
// it): anything that is not a GPU of the node is the agent's to report.
func SplitCordon(value string) []string {
	var out []string
	for f := range strings.SplitSeq(value, ",") {
		f = strings.TrimSpace(f)
		if f != "" && !slices.Contains(out, f) {
			out = append(out, f)
		}
	}
	return out
}

// EditCordon changes node's cordon annotation to edit(its GPUs) and returns
// the GPUs it lists then. The patch carries the resourceVersion read, so two
// admins editing at once cannot lose each other's change: the loser reads
// again (a few times). An empty list removes the annotation.
func EditCordon(ctx context.Context, client kubernetes.Interface, node string, edit func([]string) []string) ([]string, error) {
	for attempt := 0; ; attempt++ {
		n, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("node %s: %w", node, err)
		}
		before := SplitCordon(n.Annotations[CordonAnnotation])
		after := edit(slices.Clone(before))
		if slices.Equal(before, after) {
			return after, nil
		}
		var value any // JSON null removes the annotation
		if len(after) > 0 {
			value = strings.Join(after, ",")
		}
		body, err := json.Marshal(map[string]any{"metadata": map[string]any{
			"resourceVersion": n.ResourceVersion,
			"annotations":     map[string]any{CordonAnnotation: value},
		}})
		if err != nil {
			return nil, err
		}
		_, err = client.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, body, metav1.PatchOptions{FieldManager: "gpu-agent-cordon"})
		if err == nil {
			return after, nil
		}
		if !apierrors.IsConflict(err) || attempt >= 4 {
			return nil, fmt.Errorf("node %s: annotate %s: %w", node, CordonAnnotation, err)
		}
	}
}
